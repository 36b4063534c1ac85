"""Run four checks against text_tools (from the working directory) and write the reward."""

import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the workspace, not /tests

import text_tools

CHECKS = [
    ("shout", lambda: text_tools.shout("hi") == "HI!"),
    ("initials", lambda: text_tools.initials("ada lovelace") == "AL"),
    ("count_vowels", lambda: text_tools.count_vowels("AbcdE io") == 4),
    ("reverse_words", lambda: text_tools.reverse_words("a  b c") == "c b a"),
]

passed = 0
for name, check in CHECKS:
    try:
        ok = bool(check())
    except Exception as exc:
        ok = False
        print(f"{name}: {exc!r}")
    print(f"{name}: {'ok' if ok else 'FAILED'}")
    passed += ok
result = {"reward": passed / len(CHECKS), "checks_passed": passed, "checks_total": len(CHECKS)}
with open("/logs/verifier/reward.json", "w") as handle:
    json.dump(result, handle)
