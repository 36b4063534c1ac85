"""Reward files (/logs/verifier/reward.json or reward.txt) read for the rule `file`."""

from __future__ import annotations

import json
import math
import os
import stat

from .errors import EpisodeError
from .judging import CAUSE_BAD_REWARD_FILE, CAUSE_NO_REWARD_FILE

# In VERIFIER_DIR, the first that exists is read (as rollout_wire.request.REWARD_FILES says).
REWARD_FILE_NAMES = ("reward.json", "reward.txt")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# A reward file is read up to this size, and a reward beyond this magnitude is refused: a file
# the code under test can write must not hand the trainer 1e308 or a gigabyte to parse.
MAX_REWARD_FILE_BYTES = 64 * 1024
MAX_REWARD_MAGNITUDE = 1000.0


class RewardFileProblem(EpisodeError):
    """The tests left no usable reward file: a reward of 0, with the row's grade_cause."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def read_reward(directory: str) -> tuple[float, dict | None]:
    """(reward, other numbers or None) from the first of the verifier's reward files that
    exists. RewardFileProblem naming the file when none does or the one found is not one
    bounded number (or a JSON object with one)."""
    paths = [os.path.join(directory, name) for name in REWARD_FILE_NAMES]
    for path in paths:
        if os.path.lexists(path):
            text = _reward_file_text(path)
            return _reward_json(path, text) if path.endswith(".json") else _reward_text(path, text)
    raise RewardFileProblem(
        f"the tests wrote no reward: none of {', '.join(paths)}", CAUSE_NO_REWARD_FILE
    )


def _bad_reward(message: str) -> RewardFileProblem:
    return RewardFileProblem(message, CAUSE_BAD_REWARD_FILE)


def _reward_file_text(path: str) -> str:
    """A regular file's text, at most MAX_REWARD_FILE_BYTES (never through a link, never a
    FIFO that would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise _bad_reward(f"{path} cannot be read: {exc}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _bad_reward(f"{path} is not a regular file")
        data = handle.read(MAX_REWARD_FILE_BYTES + 1)
    if len(data) > MAX_REWARD_FILE_BYTES:
        raise _bad_reward(f"{path} is larger than {MAX_REWARD_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_reward(f"{path} is not UTF-8 text") from None


def _bounded(value: object) -> bool:
    return _number(value) and math.isfinite(value) and abs(value) <= MAX_REWARD_MAGNITUDE  # type: ignore[arg-type]


def _reward_text(path: str, text: str) -> tuple[float, dict | None]:
    try:
        reward = float(text.strip())
    except ValueError:
        raise _bad_reward(f"{path} does not hold one number") from None
    if not _bounded(reward):
        raise _bad_reward(
            f"{path} holds {reward}, not a finite number within +-{MAX_REWARD_MAGNITUDE:g}"
        )
    return reward, None


def _json_number(text: str) -> float:
    # Integers as floats (a 400-digit integer becomes inf, refused below, instead of an
    # overflow later); NaN and Infinity refused here.
    return float(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _reward_json(path: str, text: str) -> tuple[float, dict | None]:
    """A numeric `reward` (else the only number) of a JSON object; its other numbers are the
    details. A bare number is the reward alone."""
    try:
        value = json.loads(text, parse_int=_json_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise _bad_reward(f"{path} is not JSON: {exc}") from None
    if _number(value):
        value = {"reward": value}
    numbers = {k: v for k, v in value.items() if _bounded(v)} if isinstance(value, dict) else {}
    if isinstance(value, dict) and "reward" in value:
        key = "reward"
    elif len(numbers) == 1:
        key = next(iter(numbers))
    else:
        raise _bad_reward(f"{path} holds no numeric reward (nor a single number)")
    if key not in numbers:
        raise _bad_reward(
            f"{path}: reward {value[key]!r} is not a finite number within "
            f"+-{MAX_REWARD_MAGNITUDE:g}"
        )
    details = {k: float(v) for k, v in numbers.items() if k != key}
    reward = numbers[key]
    return (int(reward) if reward == int(reward) else reward), details or None
