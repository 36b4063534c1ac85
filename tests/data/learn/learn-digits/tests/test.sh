#!/bin/bash
# The share of the answer's first eight characters that are of the wanted kind, as the reward
# (score.py writes /logs/verifier/reward.json); nothing written is reward 0.
mkdir -p /logs/verifier
python3 -B /tests/score.py
