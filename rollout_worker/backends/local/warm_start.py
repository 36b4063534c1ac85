"""The supervisor's warm starts: each free slot's next episode handed to a waiting sandbox of
the run's warm pool (local/pool.py) instead of a cold start."""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from rollout_wire.request import BatchSpec
from rollout_worker.backends.local.files import RunDir
from rollout_worker.backends.local.output import Running
from rollout_worker.backends.local.policy_proxy import EpisodeIdentity, PolicyProxy
from rollout_worker.backends.local.pool import POLICY_SOCKET, PoolDir, Taken, take
from rollout_worker.backends.warm import handover_line


class Supervisor(Protocol):
    """What of the supervisor (local/supervisor.py) a warm start reads and changes."""

    run: dict[str, Any]
    spec: BatchSpec
    dir: RunDir
    pending: deque[int]
    running: dict[int, Running]
    parallelism: int
    pool_empty: bool
    proxy: PolicyProxy | None
    episode_timeout: int
    run_deadline: float

    def episode_id(self, index: int) -> str: ...

    def track(self, item: Running) -> None: ...


def take_warm(sup: Supervisor) -> None:
    """Each free slot's next episode from a waiting sandbox of the run's warm pool, if it
    has one (the pool starts a replacement for each, so it stays ahead of the batch);
    what the pool cannot give starts cold."""
    pool_path = sup.run.get("pool_dir")
    free = min(len(sup.pending), sup.parallelism - len(sup.running))
    if not pool_path or free <= 0 or sup.pool_empty:
        return
    if any({"tests", "env", "steps"} & set(task) for task in sup.spec.tasks):
        # A warm sandbox has no grader's sandbox behind it and would be handed the tests
        # with its task: such episodes start cold (two sandboxes each), as do tasks with
        # env tables (a hand-over line carries no secret).
        return
    taken = take(PoolDir(Path(pool_path)), free, refill=True)
    if not taken and not PoolDir(Path(pool_path)).alive():
        sup.pool_empty = True  # the pool stopped: do not ask it again
    for sandbox in taken:
        start_warm(sup, sup.pending.popleft(), sandbox)


def start_warm(sup: Supervisor, index: int, sandbox: Taken) -> None:
    """Hand episode `index` to a waiting sandbox (its task on stdin); one that ended while it
    waited sends the episode back to start cold."""
    claimed_at = time.time()
    access = None
    if sup.proxy is not None:
        episode = sup.spec.episode(index)
        identity = EpisodeIdentity(
            sup.episode_id(index), episode.group_id, episode.task_id, episode.sample, 0
        )
        sup.proxy.open(index, identity, path=sandbox.io / "policy.sock")
        access = {"ROLLOUT_POLICY_SOCKET": POLICY_SOCKET}
    line = memoryview(
        handover_line(
            sup.spec, index, env={"EPISODE_ID": sup.episode_id(index)}, policy_access=access
        )
    )
    try:
        while line:
            line = line[os.write(sandbox.stdin, line) :]
    except OSError:
        # The sandbox ended while it waited: this episode starts cold instead.
        for fd in (sandbox.out, sandbox.status, sandbox.pidfd):
            os.close(fd)
        if sup.proxy is not None:
            sup.proxy.close(index)
        sup.pending.appendleft(index)
        return
    finally:
        os.close(sandbox.stdin)
    sup.dir.log(index).parent.mkdir(parents=True, exist_ok=True)
    log = open(sup.dir.log(index), "wb")  # noqa: SIM115 - closed in finish()
    os.set_blocking(sandbox.out, False)
    deadline = min(claimed_at + sup.episode_timeout, sup.run_deadline)
    sup.track(
        Running(index, None, sandbox.pidfd, sandbox.out, log, claimed_at, 0, deadline, warm=sandbox)
    )
