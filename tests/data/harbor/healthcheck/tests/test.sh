#!/bin/bash
# Reward 1 when the agent started after the check's second attempt (ready.txt says 2) and the
# check ran again, twice, in this fresh grader's sandbox before these tests.
mkdir -p /logs/verifier
if [ "$(tr -d ' ' < ready.txt 2>/dev/null)" = 2 ] \
    && [ "$(wc -l < /tmp/health-attempts 2>/dev/null)" = 2 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo "ready.txt: $(cat ready.txt 2>&1); grader's attempts: $(wc -l < /tmp/health-attempts 2>&1)"
    echo 0 > /logs/verifier/reward.txt
fi
