"""Step events: the token record, the response as recorded, fitted within the event limit."""

from __future__ import annotations

import json

from .events import event_line, truncate, write_event

# A server response larger than this is not copied into the step event (which the collectors
# refuse above 256 KiB); its size and digest are kept instead.
MAX_RESPONSE_BYTES = 192 * 1024
# The collectors refuse an event above 256 KiB: a step event is fitted below this.
MAX_STEP_EVENT_BYTES = 240 * 1024
MAX_MESSAGE_TEXT = 16 * 1024


def recorded(raw: bytes, shown: object) -> object:
    """A response as its step records it: `shown` (the ids moved to the token record), or
    the raw answer's size and digest when even that is above MAX_RESPONSE_BYTES."""
    if len(raw) > MAX_RESPONSE_BYTES and _json_size(shown) > MAX_RESPONSE_BYTES:
        return omitted(raw)
    return shown


def omitted(data: bytes) -> dict:
    # Here, not at the top: hashlib starts OpenSSL (as artifacts.py says), and few steps
    # are ever this large.
    import hashlib

    return {"omitted_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _json_size(value: object) -> int:
    return len(json.dumps(value))  # ASCII (ensure_ascii): characters are bytes


def _cut_texts(value: object) -> object:
    if isinstance(value, str):
        return truncate(value, MAX_MESSAGE_TEXT)[0]
    if isinstance(value, list):
        return [_cut_texts(v) for v in value]
    if isinstance(value, dict):
        return {k: _cut_texts(v) for k, v in value.items()}
    return value


def turn_tokens(response: dict, previous: list) -> tuple[dict, list, dict]:
    """(the step's `tokens` record, the turn's prompt + completion ids, the response to record)
    from a chat completion: the server's own ids (vLLM's top-level `prompt_token_ids` and each
    choice's `token_ids`; SGLang's per choice, `prompt_token_ids` and `response_token_ids`)
    and its log-probabilities, the prompt stored
    beyond what it shares with `previous` (the last turn's prompt + completion). The recorded
    response leaves out the ids (they are in the record, stored once)."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    choice = choice if isinstance(choice, dict) else {}
    prompt = response.get("prompt_token_ids")
    if prompt is None:
        prompt = choice.get("prompt_token_ids")
    completion = choice.get("token_ids")
    if completion is None:
        completion = choice.get("response_token_ids")  # SGLang's name (0.5.23)
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    record: dict
    whole: list = []
    if not isinstance(prompt, list) or not isinstance(completion, list):
        record = {"unavailable": "the server sent no token ids (prompt_token_ids, token_ids)"}
    elif not _all_ints(prompt) or not _all_ints(completion):
        record = {"unavailable": "the server's token ids are not all integers"}
    elif not isinstance(entries, list) or len(entries) != len(completion):
        record = {"unavailable": "the server sent no log-probability per sampled token"}
    else:
        values = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            record = {"unavailable": "a sampled token's log-probability is not a number"}
        else:
            reused = _shared_prefix(prompt, previous)
            record = {
                "prompt_reused": reused,
                "prompt_ids": prompt[reused:],
                "completion_ids": completion,
                "logprobs": values,
            }
            whole = prompt + completion
    shown = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    if isinstance(choices, list):
        dropped = ("token_ids", "prompt_token_ids", "response_token_ids")
        shown["choices"] = [
            {k: v for k, v in part.items() if k not in dropped} if isinstance(part, dict) else part
            for part in choices
        ]
    return record, whole, shown


def _all_ints(value: object) -> bool:
    # The types mapped in C: a generator's per-id step cost ~0.3 ms a turn of 8k ids.
    return isinstance(value, list) and set(map(type, value)) <= {int}


def _shared_prefix(ours: list, theirs: list) -> int:
    """How many leading ids two lists share, by slice comparisons (C speed): the whole of the
    shorter in an append-only conversation, else a bisection for the first difference."""
    low, high = 0, min(len(ours), len(theirs))
    if ours[:high] == theirs[:high]:
        return high
    while high - low > 1:  # ours[:low] == theirs[:low], ours[:high] != theirs[:high]
        middle = (low + high) // 2
        if ours[low:middle] == theirs[low:middle]:
            low = middle
        else:
            high = middle
    return low


def fit_step(fields: dict) -> dict:
    """The step event's fields within MAX_STEP_EVENT_BYTES: the new messages' long texts cut
    first (messages_truncated), then the largest part left out, its size and digest kept."""
    if _json_size(fields) <= MAX_STEP_EVENT_BYTES:
        return fields
    if "new_messages" in fields:  # an agent command's exchange (the built-in loop has none)
        fields = dict(
            fields, new_messages=_cut_texts(fields["new_messages"]), messages_truncated=True
        )
    parts = [key for key in ("request", "new_messages", "response", "tokens") if key in fields]
    for _ in range(len(parts)):
        if _json_size(fields) <= MAX_STEP_EVENT_BYTES:
            break
        key = max(parts, key=lambda k: _json_size(fields[k]))
        if key == "tokens":
            # Ids cut would be a guess: the turn says why it has none.
            size = _json_size(fields[key])
            fields[key] = {"unavailable": f"the turn's token record ({size} bytes) is too large"}
        else:
            fields[key] = omitted(json.dumps(fields[key]).encode())
    return fields


def turn_record(
    token_request: dict, response: dict, raw: bytes, previous: list
) -> tuple[dict, list, object]:
    """(the step's `tokens` record, the turn's prompt + completion ids, the response as the
    step records it) of a chat completion read from `raw`; the record says why there are no
    ids when the batch asked for none (`token_request` empty: tokens: false)."""
    if not token_request:
        tokens: dict = {"unavailable": "the batch asked for no token ids (tokens: false)"}
        return tokens, [], recorded(raw, response)
    tokens, sequence, shown = turn_tokens(response, previous)
    return tokens, sequence, recorded(raw, shown)


def emit_step(fields: dict, identity: dict) -> None:
    """A `step` event (the built-in loop's turn or an agent command's exchange), fitted within
    what the collectors accept; serialised once when it fits as it is."""
    line = event_line("step", {**fields, **identity})[1]
    if len(line) > MAX_STEP_EVENT_BYTES:
        line = event_line("step", {**fit_step(fields), **identity})[1]
    write_event(line)
