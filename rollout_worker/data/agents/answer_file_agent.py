"""The smallest agent: one chat completion for the task's statement, its text written to a
file the task's tests read (AGENT_ANSWER_FILE, default answer.txt). Standard library only, so
it runs on any sandbox's interpreter; the learning benchmark's harness for a tiny model.

    "agent": {"command": ["python", "-c", <this file's text>],
              "env": {"AGENT_MAX_TOKENS": "8"}}
"""

import json
import os
import urllib.request

request = {
    "model": os.environ.get("OPENAI_MODEL", "policy"),
    "messages": [{"role": "user", "content": os.environ["ROLLOUT_STATEMENT"]}],
    "max_tokens": int(os.environ.get("AGENT_MAX_TOKENS", "8")),
}
call = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(request).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(call, timeout=60) as answer:
    text = json.load(answer)["choices"][0]["message"]["content"] or ""
with open(os.environ.get("AGENT_ANSWER_FILE", "answer.txt"), "w", encoding="utf-8") as out:
    out.write(text)
print(repr(text))
