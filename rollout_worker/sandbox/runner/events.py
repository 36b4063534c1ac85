"""The event writer: one JSON line per event on stdout, and the outcome for Kubernetes."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

from .cost import LEDGER

TERMINATION_LOG = "/dev/termination-log"

# Observations (command output, file contents) longer than this are cut, and the marker says
# how much was left out. Test output in the reward event is cut the same way.
MAX_OBSERVATION_BYTES = 4096
TRUNCATION_MARKER = "\n[... {omitted} bytes truncated ...]"


# The proxy's threads and the main thread print events: one line at a time.
_EMIT_LOCK = threading.Lock()


def finite(value: object) -> object:
    """`value` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def emit(event: str, **data: object) -> dict[str, object]:
    record, line = event_line(event, data)
    write_event(line)
    if event == "ready" and os.environ.get("ROLLOUT_READY_FILE"):
        mark_ready(os.environ["ROLLOUT_READY_FILE"])
    return record


def event_line(event: str, data: dict) -> tuple[dict[str, object], str]:
    """(the event's record, its JSON line: ASCII, so its length is its size in bytes)."""
    record = {"event": event, "at": time.time(), "episode_id": os.environ["EPISODE_ID"]}
    record.update(data)
    if event in FINAL_EVENTS:
        # Measured last, so the reading covers all the sandbox did (its tests included).
        record["cost"] = LEDGER.measure()
    try:
        line = json.dumps(record, allow_nan=False)
    except ValueError:
        # A server's or agent's NaN (say, a log-probability) would make the line no JSON.
        line = json.dumps(finite(record))
    return record, line


def write_event(line: str) -> None:
    with _EMIT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def mark_ready(path: str) -> None:
    # Kubernetes: the Pod's startup probe looks for this file, so the Pod status (which the
    # workers already watch) says the episode is ready without anyone reading its log.
    try:
        with open(path, "w"):
            pass
    except OSError:
        pass  # progress only: the event in the log is what validation reads


def truncate(text: str, limit: int = MAX_OBSERVATION_BYTES) -> tuple[str, bool]:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text, False
    kept = data[:limit].decode("utf-8", "ignore")
    return kept + TRUNCATION_MARKER.format(omitted=len(data) - limit), True


def record_outcome(event: dict[str, object]) -> None:
    # Kubernetes carries this file back in the Pod status: the outcome (a reward, or an error's
    # kind and cause) survives even if the log stream is cut or never read.
    if os.path.exists(TERMINATION_LOG):
        keys: tuple = ("at", "episode_id", "reward", "baseline_exit", "tests_exit")
        if event.get("event") == "error":
            keys = ("at", "episode_id", "kind", "cause")
        elif event.get("event") == "stale":
            keys = ("at", "episode_id", "first_version", "version", "lag", "max_policy_lag")
        elif event.get("event") == "grade_pending":
            keys = ("at", "episode_id")
        summary = {k: event.get(k) for k in keys}
        if event.get("event") in ("error", "stale", "grade_pending"):
            summary[str(event["event"])] = True
        try:
            with open(TERMINATION_LOG, "w") as handle:
                handle.write(json.dumps(summary))
        except OSError:
            pass


# The events that end a sandbox's part of the episode: each carries the ledger.
FINAL_EVENTS = ("reward", "grade_pending", "stale", "error")
