"""Reward: how many of answer.txt's first 8 characters are lowercase vowels, over 8."""

import json

WANTED = set("aeiou")
with open("answer.txt", encoding="utf-8", errors="replace") as handle:
    answer = handle.read(64)[:8]
hits = sum(1 for c in answer if c in WANTED)
with open("/logs/verifier/reward.json", "w") as out:
    json.dump({"reward": hits / 8, "hits": hits}, out)
