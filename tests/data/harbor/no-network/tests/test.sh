#!/bin/bash
# Reward 1 when the oracle's probe (network.txt) and this one both found no network.
mkdir -p /logs/verifier
if [ "$(cat network.txt 2>/dev/null)" = offline ] && [ "$(python3 -B probe.py)" = offline ]
then
    echo 1 > /logs/verifier/reward.txt
else
    echo "agent's probe: $(cat network.txt 2>&1); tests' probe: $(python3 -B probe.py 2>&1)"
    echo 0 > /logs/verifier/reward.txt
fi
