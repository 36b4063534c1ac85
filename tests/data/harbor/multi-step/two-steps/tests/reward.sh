#!/bin/bash
# Shared by both steps' test.sh: reward 1 when step.txt holds exactly the expected lines.
mkdir -p /logs/verifier
if [ "$(cat step.txt 2>/dev/null)" = "$1" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
