"""The entry point: the mode from the environment, the outcome as the exit status."""

from __future__ import annotations

import json
import os
import sys

from .demo import demo
from .errors import (
    EXIT_EPISODE_ERROR,
    EXIT_INFRASTRUCTURE,
    EpisodeError,
    InfrastructureError,
    StalePolicy,
)
from .events import emit, record_outcome
from .multistep import pod_part
from .policy import Policy
from .processes import harden
from .runner import Runner
from .seed import SEED_FROM_ENV, SEED_TO_ENV, seed
from .task import episode_identity, load_task, take_hidden_tests, wait_for_handover


def agent(workspace: str) -> int:
    try:
        hidden = take_hidden_tests()
        identity = episode_identity()
        task = load_task(identity, hidden)
        raw = os.environ.get("ROLLOUT_POLICY")
        config = json.loads(raw) if raw else None
        phase = os.environ.get("ROLLOUT_PHASE") or "agent"
        if phase not in ("agent", "grade"):
            raise ValueError(f"ROLLOUT_PHASE {phase!r} is not agent or grade")
    except (OSError, ValueError, KeyError, IndexError, InfrastructureError) as exc:
        record_outcome(
            emit("error", kind="infrastructure", cause=f"no task for this episode: {exc}")
        )
        return EXIT_INFRASTRUCTURE
    root = os.path.realpath(workspace)
    policy = Policy(config, os.environ["EPISODE_ID"], identity) if config is not None else None
    runner = Runner(task, policy, identity, root)
    harden()
    try:
        decided = pod_part(runner, phase)
        if decided is not None:
            return decided
        return runner.grade_phase() if phase == "grade" else runner.run()
    except EpisodeError as exc:
        record_outcome(emit("error", kind="episode", cause=str(exc), **identity))
        return EXIT_EPISODE_ERROR
    except InfrastructureError as exc:
        record_outcome(emit("error", kind="infrastructure", cause=str(exc), **identity))
        return EXIT_INFRASTRUCTURE
    except StalePolicy as stale:
        # Exit 0: stopped on purpose, so neither a Job failure nor an infrastructure retry.
        record_outcome(emit("stale", **stale.fields, **identity))
        return 0


def main() -> int:
    if os.environ.get("ROLLOUT_PHASE") == "seed":
        # Before any episode: the image's workdir copied into the workspace volume (seed.py).
        return seed(os.environ[SEED_FROM_ENV], os.environ[SEED_TO_ENV])
    if os.environ.get("ROLLOUT_HANDOVER") == "stdin" and not wait_for_handover(sys.stdin):
        return 0
    workspace = os.environ.get("ROLLOUT_WORKSPACE", "/workspace")
    os.chdir(workspace)
    if os.environ.get("ROLLOUT_POLICY") or os.environ.get("ROLLOUT_TASKS_FILE"):
        return agent(workspace)
    return demo(os.environ.get("ROLLOUT_ACTION", "fix"))


if __name__ == "__main__":
    sys.exit(main())
