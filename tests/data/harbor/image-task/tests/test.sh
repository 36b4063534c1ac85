#!/bin/bash
# Reads /app/greet.py (the image's WORKDIR, where the agent worked); binary reward.
mkdir -p /logs/verifier
if python3 -B /tests/check_greet.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
