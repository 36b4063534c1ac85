#!/bin/bash
# Reward 1 when double() doubles (imported from the workspace), else 0.
mkdir -p /logs/verifier
if python3 -B -c 'import sys, os; sys.path.insert(0, os.getcwd()); from twice import double; sys.exit(0 if double(3) == 6 else 1)'; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
