"""Settings: one frozen object, built once from the environment at the edge (CLI, worker start).

Every variable is listed in SETTINGS_DOC: `rollout settings` shows it, docker/README.md's table
is generated from it (`docker/env_doc.py`) and docker-compose.yml passes each one through.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from rollout_wire.errors import ConfigError
from rollout_wire.redis_url import check_url
from rollout_wire.urls import redacted

SETTINGS_DOC: dict[str, str] = {
    "ROLLOUT_REDIS_URL": "Redis for the broker, results, receipts and reports: redis://, "
    "rediss:// (TLS), unix://, or Redis Sentinel: sentinel://[:PASSWORD@]HOST:26379[,HOST:PORT...]"
    "/DB?master=NAME (sentinel+rediss://...: TLS to the data nodes and Sentinels) "
    "(default redis://127.0.0.1:6379/0)",
    "ROLLOUT_MAX_BATCH_EPISODES": "largest batch accepted; larger ones are refused (default 5000)",
    "ROLLOUT_VISIBILITY_TIMEOUT": "seconds before the task of a dead worker is redelivered; must "
    "exceed every task's run time (default 40: a killed worker's work resumes within a minute)",
    "ROLLOUT_RESULT_EXPIRES": "seconds Celery keeps task results and chord state; must exceed "
    "the longest batch plus redelivery delay (default 172800)",
    "ROLLOUT_RECORD_TTL": "seconds receipts, episode rows, logs and reports stay in Redis "
    "(default 604800)",
    "ROLLOUT_COLLECT_BLOCK_SECONDS": "longest a collect task waits for its episode (on the batch's "
    "shared watch, or the local done signal) before it parks until its episode ends (or, not yet "
    "ready, requeues itself); at most half of ROLLOUT_VISIBILITY_TIMEOUT (default 15)",
    "ROLLOUT_COLLECT_GRACE_SECONDS": "after a run's deadline, how long collectors keep waiting "
    "before marking an episode lost (default 30)",
    "ROLLOUT_LOCAL_ROOT": "directory for local runs (default <tmp>/rollout-runs)",
    "ROLLOUT_LOCAL_PYTHON": "interpreter for local sandboxes (default /usr/bin/python3, else the "
    "worker's own)",
    "ROLLOUT_LOCAL_ISOLATION": "auto | bwrap | none (default auto: bwrap; when it cannot run, "
    "a batch is refused before anything starts; none only when named)",
    "ROLLOUT_ROOTFS_DIR": "local backend: where `rollout tasks build --rootfs` exported task "
    "images' root filesystems; a task whose image has one there runs in it "
    "(default <tmp>/rollout-rootfs)",
    "ROLLOUT_AGENT_ENVS": "local backend: the folders (colon-separated) a batch's agent_env may "
    "name, each shown read-only to its sandboxes (a virtual environment holding the agent); a "
    "batch naming another folder is refused (default: none)",
    "KUBECONFIG": "kubeconfig for the kubernetes backend "
    "(default: in-cluster, then ~/.kube/config)",
    "ROLLOUT_KUBE_CONTEXT": "kubeconfig context for the kubernetes backend (default: current)",
    "ROLLOUT_RUN_TTL": "seconds a kept run (keep_run) may stay before the sweeper deletes it "
    "(default 604800)",
    "ROLLOUT_SWEEP_SECONDS": "how often `rollout worker --beat` runs the sweeper (default 300)",
    "ROLLOUT_KUBE_JOB_TTL": "ttlSecondsAfterFinished of batch Jobs, a safety net for runs nobody "
    "cleans up (default 86400)",
    "ROLLOUT_POD_CREATE_RATE": "Pods per second the cluster's Job controller creates; a "
    "Kubernetes batch that cannot even be created within its deadline at this rate is refused "
    "up front, with the arithmetic; 0: do not check (default 10: a stock kube-controller-manager "
    "allows its controllers 20 requests/s, and each Pod costs a create and a finalizer patch)",
    "ROLLOUT_WARM_POOL_BUDGET": "most warm sandboxes waiting in all pools together; a batch's "
    "warm_pool refill stops there (default 64)",
    "ROLLOUT_WARM_POOL_IDLE_SECONDS": "a warm pool no batch asked to refill for this long is "
    "emptied by the sweeper (default 900)",
    "ROLLOUT_WARM_HANDOVER_THREADS": "Kubernetes: warm Pods claimed and handed their episodes "
    "at once by one worker (default 32 when hand-overs go by attach through the API server, "
    "4 with ROLLOUT_WARM_HANDOVER_FROM; sized by benchmarks/bench_warm.py)",
    "ROLLOUT_WARM_HANDOVER_FROM": "Kubernetes: hand warm Pods their episodes over a direct TCP "
    "connection from the workers (a CIDR holding the workers' addresses, e.g. their Pod CIDR, "
    "or the node's IP/32 where workers run on the node); each pool Pod then listens on one "
    "port, open to that CIDR only, until its episode arrives (token-checked); attach through "
    "the API server stays the fallback (default: empty, attach only)",
    "ROLLOUT_REDIS_OUTAGE_SECONDS": "clients (rollout run, trainer-stub, the trainer API): how "
    "long Redis may be unreachable before the client gives up with one clear error (default 60)",
}


def _default_python() -> str:
    system = "/usr/bin/python3"
    return system if os.access(system, os.X_OK) else sys.executable


# Warm Pods claimed and handed their episodes at once by one worker, sized by bench_warm on
# the 2-core real node. By attach (~40 ms of node CPU each) a burst of 100 had every episode
# ready 13.0, 8.2, 5.6, 5.1 s after submit with 4, 16, 32, 64 threads. Direct (a connection
# to the Pod) the claim patches are what crowd the node: a burst of 10 gets claim -> ready
# p50 62 ms with 4 threads against 107 ms with 32, and a burst of 100 its report as soon
# (22.6 s against 22.9 s; its last episode ready at 4.0 s against 2.7 s).
ATTACH_HANDOVER_THREADS = 32
DIRECT_HANDOVER_THREADS = 4


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    max_batch_episodes: int = 5000
    visibility_timeout: int = 40
    result_expires: int = 2 * 24 * 3600
    record_ttl: int = 7 * 24 * 3600
    collect_block_seconds: float = 15.0
    collect_grace_seconds: float = 30.0
    local_root: Path = Path(tempfile.gettempdir()) / "rollout-runs"
    local_python: str = ""
    local_isolation: str = "auto"
    kube_job_ttl_seconds: int = 24 * 3600
    pod_create_rate: float = 10.0
    run_ttl_seconds: int = 7 * 24 * 3600
    sweep_seconds: float = 300.0
    kubeconfig: str | None = None
    kube_context: str | None = None
    warm_pool_budget: int = 64
    warm_pool_idle_seconds: float = 900.0
    # None: by the hand-over (warm_handover_threads_used).
    warm_handover_threads: int | None = None
    # Direct hand-over (kube/handover.py): the CIDR allowed to reach a waiting Pod's port; None:
    # attach only.
    warm_handover_from: str | None = None
    agent_envs: tuple[str, ...] = ()
    rootfs_dir: Path = Path(tempfile.gettempdir()) / "rollout-rootfs"

    def __post_init__(self) -> None:
        problems = []
        try:
            check_url(self.redis_url)
        except ConfigError as exc:
            problems.append(f"ROLLOUT_REDIS_URL {redacted(self.redis_url)!r}: {exc}")
        if self.max_batch_episodes < 1:
            problems.append("ROLLOUT_MAX_BATCH_EPISODES must be >= 1")
        if (
            self.collect_block_seconds <= 0
            or self.collect_block_seconds * 2 > self.visibility_timeout
        ):
            problems.append(
                "ROLLOUT_COLLECT_BLOCK_SECONDS must be > 0 and at most half of "
                "ROLLOUT_VISIBILITY_TIMEOUT (a task must end well before it is redelivered)"
            )
        # A chord whose state expires before a lost task is redelivered never fires its
        # callback, and nothing logs it (seen in trials with Celery 5 on Redis), so expiry
        # must dominate the redelivery delay.
        if self.result_expires < 4 * self.visibility_timeout + 3600:
            problems.append(
                "ROLLOUT_RESULT_EXPIRES must be at least 4 x "
                "ROLLOUT_VISIBILITY_TIMEOUT + 3600 seconds (never 0)"
            )
        if not self.pod_create_rate >= 0:  # also refuses NaN
            problems.append("ROLLOUT_POD_CREATE_RATE must be >= 0 (0: do not check)")
        if self.warm_handover_threads is not None and self.warm_handover_threads < 1:
            problems.append(
                f"ROLLOUT_WARM_HANDOVER_THREADS must be at least 1, got "
                f"{self.warm_handover_threads}"
            )
        if self.warm_handover_from is not None:
            try:
                ipaddress.ip_network(self.warm_handover_from)
            except ValueError as exc:
                problems.append(
                    f"ROLLOUT_WARM_HANDOVER_FROM {self.warm_handover_from!r} is not a CIDR "
                    f"(such as 10.244.0.0/16 or 10.89.0.1/32): {exc}"
                )
        if self.warm_pool_budget < 0 or not self.warm_pool_idle_seconds > 0:
            problems.append(
                "ROLLOUT_WARM_POOL_BUDGET must be >= 0 and ROLLOUT_WARM_POOL_IDLE_SECONDS > 0"
            )
        if self.local_isolation not in ("auto", "bwrap", "none"):
            problems.append(
                f"ROLLOUT_LOCAL_ISOLATION {self.local_isolation!r} is not one of auto, bwrap, none"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        if not self.local_python:
            object.__setattr__(self, "local_python", _default_python())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}

        def number(name: str, key: str, kind: type) -> None:
            if env.get(name):
                try:
                    values[key] = kind(env[name])
                except ValueError as exc:
                    raise ConfigError(
                        f"{name}={env[name]!r} is not a valid {kind.__name__}"
                    ) from exc

        if env.get("ROLLOUT_REDIS_URL"):
            values["redis_url"] = env["ROLLOUT_REDIS_URL"]
        number("ROLLOUT_MAX_BATCH_EPISODES", "max_batch_episodes", int)
        number("ROLLOUT_VISIBILITY_TIMEOUT", "visibility_timeout", int)
        number("ROLLOUT_RESULT_EXPIRES", "result_expires", int)
        number("ROLLOUT_RECORD_TTL", "record_ttl", int)
        number("ROLLOUT_COLLECT_BLOCK_SECONDS", "collect_block_seconds", float)
        number("ROLLOUT_COLLECT_GRACE_SECONDS", "collect_grace_seconds", float)
        if env.get("ROLLOUT_LOCAL_ROOT"):
            values["local_root"] = Path(env["ROLLOUT_LOCAL_ROOT"])
        if env.get("ROLLOUT_LOCAL_PYTHON"):
            python = env["ROLLOUT_LOCAL_PYTHON"]
            resolved = shutil.which(python)
            if not resolved:
                raise ConfigError(f"ROLLOUT_LOCAL_PYTHON={python!r} is not an executable")
            values["local_python"] = resolved
        if env.get("ROLLOUT_ROOTFS_DIR"):
            values["rootfs_dir"] = Path(env["ROLLOUT_ROOTFS_DIR"])
        if env.get("ROLLOUT_AGENT_ENVS"):
            values["agent_envs"] = tuple(
                os.path.realpath(p) for p in env["ROLLOUT_AGENT_ENVS"].split(":") if p
            )
        if env.get("ROLLOUT_LOCAL_ISOLATION"):
            values["local_isolation"] = env["ROLLOUT_LOCAL_ISOLATION"]
        number("ROLLOUT_KUBE_JOB_TTL", "kube_job_ttl_seconds", int)
        number("ROLLOUT_POD_CREATE_RATE", "pod_create_rate", float)
        number("ROLLOUT_RUN_TTL", "run_ttl_seconds", int)
        number("ROLLOUT_SWEEP_SECONDS", "sweep_seconds", float)
        number("ROLLOUT_WARM_POOL_BUDGET", "warm_pool_budget", int)
        number("ROLLOUT_WARM_POOL_IDLE_SECONDS", "warm_pool_idle_seconds", float)
        number("ROLLOUT_WARM_HANDOVER_THREADS", "warm_handover_threads", int)
        values["warm_handover_from"] = env.get("ROLLOUT_WARM_HANDOVER_FROM", "").strip() or None
        values["kubeconfig"] = env.get("KUBECONFIG") or None
        values["kube_context"] = env.get("ROLLOUT_KUBE_CONTEXT") or None
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    @property
    def warm_handover_threads_used(self) -> int:
        """Claims and hand-overs one worker runs at once: ROLLOUT_WARM_HANDOVER_THREADS, else
        by how Pods are handed their episodes (ATTACH_ / DIRECT_HANDOVER_THREADS)."""
        if self.warm_handover_threads is not None:
            return self.warm_handover_threads
        return DIRECT_HANDOVER_THREADS if self.warm_handover_from else ATTACH_HANDOVER_THREADS

    def with_redis(self, redis_url: str) -> Settings:
        return replace(self, redis_url=redis_url)
