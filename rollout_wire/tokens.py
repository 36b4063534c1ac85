"""An episode's token view: the exact ids the policy engine was shown and sampled, as trainers
consume them (token-in-token-out; never ids made again from text).

Each answered turn's `step` event carries `tokens`, taken by the runner from the server's own
fields (vLLM's `prompt_token_ids` and each choice's `token_ids`, the choice's log-probabilities):
{prompt_reused, prompt_ids, completion_ids, logprobs}, where the turn's prompt is the first
`prompt_reused` ids of the previous turn's prompt + completion followed by `prompt_ids` (so a
long conversation is not stored once per turn), or {unavailable: why}.

`token_view(steps)` turns them into one of two layouts:
- `sequence` when the turns are append-only (each prompt begins with the previous prompt and
  completion): `prompt_ids` (the first prompt), `response_ids` (every later id: the model's
  completions and, between them, what the environment added), `response_mask` (1 for the
  model's ids, 0 for the environment's), `response_logprobs` (0.0 on the environment's ids) and
  `turns` (each completion's [start, end) in `response_ids` with its policy version);
- `stepwise` otherwise (a scaffold that rewrote its context): one sample per turn in
  `samples`, and `prefix_broke_at` names the first turn (1-based) whose prompt did not extend
  the one before.
`tokens` is `available`, or `unavailable` with `reason` (a server that sent no ids, a turn that
failed): never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

AVAILABLE = "available"
UNAVAILABLE = "unavailable"
SEQUENCE = "sequence"
STEPWISE = "stepwise"


def unavailable(reason: str) -> dict[str, Any]:
    return {"tokens": UNAVAILABLE, "reason": reason}


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(i) is int for i in value):
        return value
    return None


def _logprobs(value: Any, count: int) -> list[float] | None:
    if (
        isinstance(value, list)
        and len(value) == count
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    ):
        return [float(x) for x in value]
    return None


def token_view(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The episode's token view from its trajectory's steps (see the module's text)."""
    turns: list[tuple[list[int], list[int], list[float], Any]] = []
    previous: list[int] = []
    broke_at = None
    for step in steps:
        if step.get("response") is None:
            continue  # a failed exchange: the agent saw no completion, nothing was sampled
        number = len(turns) + 1
        record = step.get("tokens")
        if not isinstance(record, dict):
            return unavailable(f"turn {number} has no token record")
        if UNAVAILABLE in record:
            return unavailable(f"turn {number}: {record[UNAVAILABLE]}")
        new = _ids(record.get("prompt_ids"))
        completion = _ids(record.get("completion_ids"))
        reused = record.get("prompt_reused")
        if new is None or completion is None or type(reused) is not int:
            return unavailable(f"turn {number}'s token record is malformed")
        if not 0 <= reused <= len(previous):
            return unavailable(f"turn {number} reuses {reused} ids of {len(previous)}")
        logprobs = _logprobs(record.get("logprobs"), len(completion))
        if logprobs is None:
            return unavailable(f"turn {number} has no log-probability per completion id")
        prompt = previous[:reused] + new
        if turns and reused < len(previous) and broke_at is None:
            broke_at = number
        turns.append((prompt, completion, logprobs, step.get("policy_version")))
        previous = prompt + completion
    if not turns:
        return unavailable("no turn was answered")
    if broke_at is not None:
        return {
            "tokens": AVAILABLE,
            "layout": STEPWISE,
            "prefix_broke_at": broke_at,
            "samples": [
                {
                    "prompt_ids": prompt,
                    "response_ids": completion,
                    "response_mask": [1] * len(completion),
                    "response_logprobs": logprobs,
                    "policy_version": version,
                }
                for prompt, completion, logprobs, version in turns
            ],
        }
    first = turns[0][0]
    response: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    bounds = []
    sequence = list(first)
    for prompt, completion, logprobs, version in turns:
        added = prompt[len(sequence) :]  # what the environment said since the last turn
        response += added
        mask += [0] * len(added)
        logps += [0.0] * len(added)
        end = len(response) + len(completion)
        bounds.append({"start": len(response), "end": end, "policy_version": version})
        response += completion
        mask += [1] * len(completion)
        logps += logprobs
        sequence = prompt + completion
    return {
        "tokens": AVAILABLE,
        "layout": SEQUENCE,
        "prefix_broke_at": None,
        "prompt_ids": first,
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": logps,
        "turns": bounds,
    }
