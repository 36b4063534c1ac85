#!/bin/bash
# Harbor's verifier contract: the reward goes to /logs/verifier/reward.txt (here 1 or 0).
# Runs from the workspace, so the check imports the agent's calc.py from there.
mkdir -p /logs/verifier
if python3 -B /tests/check_add.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
