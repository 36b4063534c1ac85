"""Server-sent events read as they arrive, and a stream's chunks assembled into one answer."""

from __future__ import annotations

import json
import re

# One read of a response stream or a pipe.
STREAM_READ = 65536


class EventStream:
    """Server-sent events as they arrive: each complete event's raw bytes, and the JSON chunks
    their data lines carry."""

    BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")

    def __init__(self) -> None:
        self.buffer = b""
        self.chunks: list = []
        self.size = 0

    def feed(self, data: bytes) -> list:
        """[(raw event, whether it is the closing `data: [DONE]`)] that `data` completes."""
        self.size += len(data)
        self.buffer += data
        found: list = []
        while True:
            match = self.BOUNDARY.search(self.buffer)
            if match is None:
                return found
            raw, self.buffer = self.buffer[: match.end()], self.buffer[match.end() :]
            found.append((raw, self.parse(raw[: match.start()])))

    def parse(self, event: bytes) -> bool:
        data = [
            line[5:][1:] if line[5:6] == b" " else line[5:]
            for line in re.split(rb"\r\n|\r|\n", event)
            if line.startswith(b"data:")
        ]
        text = b"\n".join(data).decode("utf-8", "replace").strip()
        if text == "[DONE]":
            return True
        try:
            value = json.loads(text)
        except ValueError:
            return False  # a comment, a keep-alive or junk: forwarded, not assembled
        if isinstance(value, dict):
            self.chunks.append(value)
        return False


def _merge_delta(message: dict, delta: dict) -> None:
    for key, value in delta.items():
        if value is None:
            continue
        if key == "tool_calls" and isinstance(value, list):
            calls = message.setdefault("tool_calls", {})
            for part in value:
                if not isinstance(part, dict):
                    continue
                call = calls.setdefault(part.get("index", len(calls)), {})
                for name, piece in part.items():
                    if name == "function" and isinstance(piece, dict):
                        function = call.setdefault("function", {})
                        for field, text in piece.items():
                            if isinstance(text, str):
                                function[field] = function.get(field, "") + text
                            elif text is not None:
                                function[field] = text
                    elif name in ("id", "type"):
                        call[name] = call.get(name) or piece
                    elif name != "index" and piece is not None:
                        call[name] = piece
        elif key == "role":
            message["role"] = value
        elif isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        else:
            message[key] = value


def assemble_stream(chunks: list) -> dict:
    """One chat.completion from a stream's chat.completion.chunk objects, as the OpenAI client
    accumulates them: texts concatenated, tool calls merged by index, the last finish_reason,
    log-probability entries and token ids concatenated, the other fields (usage, the SGLang
    metadata) as the last chunk that has them says."""
    result: dict = {}
    choices: dict = {}
    for chunk in chunks:
        for key, value in chunk.items():
            if key != "choices" and value is not None:
                result[key] = value
        for part in chunk.get("choices") or []:
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            choice = choices.setdefault(
                index,
                {
                    "index": index,
                    "message": {"role": "assistant", "content": None},
                    "finish_reason": None,
                },
            )
            for key, value in part.items():
                if value is None or key == "index":
                    continue
                if key == "delta" and isinstance(value, dict):
                    _merge_delta(choice["message"], value)
                elif key == "logprobs" and isinstance(value, dict):
                    logprobs = choice.setdefault("logprobs", {})
                    for name, entries in value.items():
                        if isinstance(entries, list):
                            logprobs[name] = (logprobs.get(name) or []) + entries
                        elif entries is not None:
                            logprobs[name] = entries
                elif isinstance(value, list) and isinstance(choice.get(key), list):
                    choice[key] = choice[key] + value
                else:
                    choice[key] = value
    for choice in choices.values():
        calls = choice["message"].get("tool_calls")
        if isinstance(calls, dict):
            choice["message"]["tool_calls"] = [calls[i] for i in sorted(calls, key=_by_index)]
    result["object"] = "chat.completion"
    result["choices"] = [choices[i] for i in sorted(choices, key=_by_index)]
    return result


def _by_index(index: object) -> tuple:
    # Indexes are integers; anything else a server sends sorts after them instead of failing.
    return (0, index, "") if isinstance(index, int) else (1, 0, str(index))
