#!/bin/bash
# [verifier] environment_mode = "separate": the tests get the agent's workspace alone, not its
# /tmp (the oracle leaves a file there, which a shared grader would still see).
mkdir -p /logs/verifier
if grep -qx done answer.txt 2>/dev/null && [ ! -e /tmp/left-by-the-agent ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
