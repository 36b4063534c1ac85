#!/bin/bash
# Reward 1 when report.txt holds the sum (12); the runner then keeps report.txt and
# /logs/agent as the episode's artifacts.
mkdir -p /logs/verifier
if [ "$(cat report.txt 2>/dev/null)" = 12 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
