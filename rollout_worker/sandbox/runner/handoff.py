"""What passes from the agent's sandbox to its grader (the baseline's counts) and the
variables a backend sets for grading elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

# The baseline's counts ({collected, skipped}, JSON) for a grading sandbox, from its agent
# sandbox's grade_pending.
BASELINE_TESTS_ENV = "ROLLOUT_BASELINE_TESTS"
# A folder the agent's runner and its grader share (a Pod's init container and container):
# the baseline's counts travel there when no backend passes BASELINE_TESTS_ENV.
HANDOFF_ENV = "ROLLOUT_HANDOFF_DIR"
HANDOFF_NAME = "baseline.json"


def replace_json(folder: str, name: str, value: object) -> None:
    """`value` as JSON at folder/name, written to a new file and renamed over whatever was left
    at that name (a file, a link, a folder the agent planted). OSError when it cannot be."""
    target = os.path.join(folder, name)
    if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
    handle, temporary = tempfile.mkstemp(dir=folder)
    with os.fdopen(handle, "w") as out:
        json.dump(value, out)
    os.replace(temporary, target)


def hand_over(promise: dict | None) -> None:
    """Leave the baseline's counts for the grader (after every agent process is gone)."""
    folder = os.environ.get(HANDOFF_ENV)
    if not folder:
        return
    with contextlib.suppress(OSError):
        replace_json(folder, HANDOFF_NAME, promise)


def handed_over() -> str | None:
    folder = os.environ.get(HANDOFF_ENV)
    if not folder:
        return None
    try:
        fd = os.open(os.path.join(folder, HANDOFF_NAME), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as handle:
            return handle.read(4096)
    except (OSError, UnicodeDecodeError):
        return None


# Set by a backend whose grader shares folders with the agent's sandbox besides the
# workspace (Kubernetes: the Pod's /tmp, /logs and /dev/shm), ':'-separated.
SHARED_DIRS_ENV = "ROLLOUT_SHARED_DIRS"
# Set by a backend that grades in a second sandbox whatever the task's `grade` (the local one,
# for tasks whose tests the agent must not see): the agent's sandbox then ends with
# grade_pending.
GRADER_ENV = "ROLLOUT_GRADER"
