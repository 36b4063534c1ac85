#!/bin/bash
# Reward 1 when the oracle saw exactly [environment.env] + [solution.env] (seen.txt) and these
# tests see exactly [environment.env] + [verifier.env]; an untouched workspace has no seen.txt.
mkdir -p /logs/verifier
oracle_saw="SHOWN=shown-to-all
JUDGE=unset
HINT=oracle-only
BOTH=from-solution"
tests_see="SHOWN=${SHOWN-unset} JUDGE=${JUDGE-unset} HINT=${HINT-unset} BOTH=${BOTH-unset}"
if [ "$(cat seen.txt 2>/dev/null)" = "$oracle_saw" ] \
    && [ "$tests_see" = "SHOWN=shown-to-all JUDGE=judge-only HINT=unset BOTH=from-verifier" ]
then
    echo 1 > /logs/verifier/reward.txt
else
    echo "seen.txt: $(cat seen.txt 2>&1 | tr '\n' ' '); tests see: $tests_see"
    echo 0 > /logs/verifier/reward.txt
fi
