"""The byte-level tokenizer and chat template of the project's two test engines (the scripted
policy server, rollout_worker/cli/policy_server.py, and the tiny model, trainer_stub/engine.py):
a byte b is the id b + BYTE_OFFSET; each message renders as [START, role] + its body + [END];
an assistant message's body is the ids of its text (or of each tool call's name and
arguments); a prompt ends with [START, assistant]. END is also what an answer ends with (a
real engine's EOS), so a conversation that carries each answer back unchanged is append-only,
as on vLLM with a real model's template, and one that rewrites its context is not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

# The byte-level tokenizer's special ids; a byte b is the id b + BYTE_OFFSET.
START, END, BYTE_OFFSET = 1, 2, 16
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6}


def text_ids(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode("utf-8", "replace")]


def answer_text(message: Mapping[str, Any]) -> str:
    """What an assistant message's completion ids spell: its text, or each tool call's name
    and arguments."""
    calls = message.get("tool_calls") or []
    if calls:
        return "".join(
            str((c.get("function") or {}).get("name", ""))
            + str((c.get("function") or {}).get("arguments", ""))
            for c in calls
            if isinstance(c, Mapping)
        )
    content = message.get("content")
    return content if isinstance(content, str) else orjson.dumps(content).decode()


def render_prompt(messages: Any) -> list[int]:
    """The prompt ids of `messages` under the server's chat template (see the module's text),
    ending with the assistant's turn opened."""
    ids: list[int] = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, Mapping):
            continue
        role = str(message.get("role", "user"))
        if role == "assistant":
            body = text_ids(answer_text(message))
        else:
            content = message.get("content")
            body = text_ids(content if isinstance(content, str) else orjson.dumps(content).decode())
        ids += [START, ROLE_IDS.get(role, ROLE_IDS["user"]), *body, END]
    return [*ids, START, ROLE_IDS["assistant"]]


VOCAB_SIZE = BYTE_OFFSET + 256


def decode(ids: list[int]) -> str:
    """The text of completion ids: their bytes (special ids dropped), invalid UTF-8 replaced."""
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < VOCAB_SIZE).decode(
        "utf-8", "replace"
    )
