#!/bin/bash
# Reward 1 when size.txt holds 400 MiB in bytes (the oracle's allocation succeeded).
mkdir -p /logs/verifier
if [ "$(cat size.txt 2>/dev/null)" = 419430400 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
