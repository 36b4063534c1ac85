#!/bin/bash
# A fractional reward: score.py writes /logs/verifier/reward.json with the share of the four
# checks that pass, e.g. {"reward": 0.75, "checks_passed": 3, "checks_total": 4}.
mkdir -p /logs/verifier
python3 -B /tests/score.py || echo '{"reward": 0, "checks_passed": 0, "checks_total": 4}' \
    > /logs/verifier/reward.json
