"""The smallest agent: chat completions for the task's statement, the last answer's text
written to a file the task's tests read (AGENT_ANSWER_FILE, default answer.txt). With
AGENT_TURNS=n (default 1) it asks n times in one conversation, each answer carried back
unchanged followed by "Again." (a multi-turn, append-only conversation). Standard library only,
so it runs on any sandbox's interpreter: the learning benchmark's harness for a tiny model.

    "agent": {"command": ["python", "-c", <this file's text>],
              "env": {"AGENT_MAX_TOKENS": "8", "AGENT_TURNS": "2"}}
"""

import json
import os
import urllib.request

messages = [{"role": "user", "content": os.environ["ROLLOUT_STATEMENT"]}]
text = ""
for turn in range(int(os.environ.get("AGENT_TURNS", "1"))):
    if turn:
        messages.append({"role": "user", "content": "Again."})
    request = {
        "model": os.environ.get("OPENAI_MODEL", "policy"),
        "messages": messages,
        "max_tokens": int(os.environ.get("AGENT_MAX_TOKENS", "8")),
    }
    call = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(request).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(call, timeout=60) as answer:
        message = json.load(answer)["choices"][0]["message"]
    messages.append({"role": "assistant", "content": message.get("content") or ""})
    text = message.get("content") or ""
with open(os.environ.get("AGENT_ANSWER_FILE", "answer.txt"), "w", encoding="utf-8") as out:
    out.write(text)
print(repr(text))
