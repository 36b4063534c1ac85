"""The embedded local backend: a batch runs as sandboxed processes on this machine.

The run is supervised by a detached process (see local/supervisor.py), not by a Celery task, so no
worker slot is held while episodes run. All workers of a deployment using this backend must
share the filesystem under ROLLOUT_LOCAL_ROOT (one machine, or a shared volume).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import orjson

from rollout_wire.errors import BackendError, BackendUnavailable, OwnershipError
from rollout_wire.request import BatchSpec
from rollout_wire.states import RunVerdict
from rollout_wire.task_spec import missing_task_env
from rollout_worker.backends import warm
from rollout_worker.backends.base import (
    MAX_LOG_BYTES,
    FinishedRun,
    LocalRunHandle,
    ReceiptUpdate,
    RunHandle,
    handle_as,
)
from rollout_worker.backends.local.files import (
    LOG_CUT_MARK,
    OWNER,
    RunDir,
    create_json_exclusive,
    spawn_detached,
    write_json_atomic,
)
from rollout_worker.backends.local.pool import PoolDir, ask
from rollout_worker.backends.local.run_file import describe_python, run_document, write_program
from rollout_worker.backends.local.sandbox import ImageRoot
from rollout_worker.backends.local.signal import DoneSignal
from rollout_worker.observation import EpisodeObservation
from rollout_worker.quantities import sandbox_limits, storage_bytes
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings

# How long a cancel waits for the supervisor to stop its sandboxes (longer under heavy load).
CANCEL_WAIT_SECONDS = 30.0


@functools.lru_cache(maxsize=4)
def probe_bwrap() -> str | None:
    """None when bubblewrap can build a sandbox here, else why it cannot."""
    if not shutil.which("bwrap"):
        return "bwrap is not installed (apt-get install bubblewrap)"
    try:
        # As the sandboxes run it: as uid 1000 on the host when we are root.
        root = os.geteuid() == 0
        done = subprocess.run(
            ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--uid", "1000", "true"],
            capture_output=True,
            timeout=10,
            text=True,
            user=1000 if root else None,
            group=1000 if root else None,
            extra_groups=[] if root else None,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap failed to run: {exc}"
    return (
        None if done.returncode == 0 else f"bwrap cannot create namespaces: {done.stderr.strip()}"
    )


def _closed_to_others(path: Path) -> Path | None:
    """The first existing ancestor of `path` that other users cannot traverse, if any."""
    for part in [path, *path.parents]:
        if part.exists() and not part.stat().st_mode & stat.S_IXOTH:
            return part
    return None


class LocalBackend:
    name = "local"
    streams_progress = True  # the supervisor streams running/ready from the runner's output

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.local_root
        self._signal: DoneSignal | None = None

    # -- helpers -----------------------------------------------------------------------------
    def _isolation(self) -> str:
        """Bubblewrap, or no sandbox only when asked for by name: `auto` never falls back to
        unsandboxed episodes (an agent could then reach Redis and the host), it refuses."""
        wanted = self.settings.local_isolation
        if wanted == "none":
            return "none"
        problem = probe_bwrap()
        if problem:
            raise BackendUnavailable(
                f"local sandboxes need bubblewrap (ROLLOUT_LOCAL_ISOLATION={wanted}) but "
                f"{problem}; to run episodes without a sandbox, on purpose, set "
                "ROLLOUT_LOCAL_ISOLATION=none"
            )
        return "bwrap"

    def _dir(self, handle: RunHandle) -> RunDir:
        run_dir = handle_as(LocalRunHandle, handle).run_dir
        assert run_dir is not None, "not a local run"
        return RunDir(Path(run_dir))

    # -- protocol ----------------------------------------------------------------------------
    def preflight(self, spec: BatchSpec) -> list[str]:
        warnings = []
        if not os.access(self.settings.local_python, os.X_OK):
            raise BackendUnavailable(
                f"sandbox interpreter {self.settings.local_python} is not "
                "executable (ROLLOUT_LOCAL_PYTHON)"
            )
        if self._isolation() == "none":
            warnings.append("local sandboxes are NOT isolated: ROLLOUT_LOCAL_ISOLATION=none")
        _refuse_missing_task_env(spec)
        if spec.task_env_secret is not None:
            warnings.append(
                f"task_env_secret {spec.task_env_secret!r} is for Kubernetes: the local backend "
                "resolves the tasks' ${VAR} from its workers' environment"
            )
        for task in spec.tasks:
            # A task that is only its image (a Harbor Dockerfile) runs in that image's files.
            image = task.get("image")
            if image and not task.get("files") and self._isolation() != "bwrap":
                raise BackendUnavailable(
                    f"task {task['id']!r} runs in its image {image}: that needs bwrap isolation"
                )
            if task.get("workdir") and self._isolation() != "bwrap":
                # Without bwrap the workspace is a host folder: it cannot be put at a path.
                raise BackendUnavailable(
                    f"task {task['id']!r} works in {task['workdir']} (its workdir): that needs "
                    "bwrap isolation"
                )
            if (
                image
                and not task.get("files")
                and not ImageRoot.find(self.settings.rootfs_dir, image)
            ):
                raise BackendUnavailable(
                    f"task {task['id']!r} runs in its image {image}, whose root filesystem is not "
                    f"in {self.settings.rootfs_dir}: run `rollout tasks build <tasks folder> "
                    f"--rootfs {self.settings.rootfs_dir}` (ROLLOUT_ROOTFS_DIR) first"
                )
        if spec.agent_env is not None:
            allowed = self.settings.agent_envs
            real = os.path.realpath(spec.agent_env)
            if real not in allowed:
                raise BackendUnavailable(
                    f"agent_env {spec.agent_env} is not a folder this worker shows to sandboxes "
                    f"(ROLLOUT_AGENT_ENVS: {':'.join(allowed) or 'none'})"
                )
            if not os.path.isdir(real):
                raise BackendUnavailable(f"agent_env {spec.agent_env} is not a directory here")
        if os.geteuid() == 0:
            closed = _closed_to_others(self.root)
            if closed is not None:
                raise BackendUnavailable(
                    f"{closed} is closed to other users (mode {closed.stat().st_mode & 0o777:o}), "
                    f"so sandboxes (uid 1000 on this host) cannot reach runs under {self.root}; "
                    "choose another ROLLOUT_LOCAL_ROOT or open the directory (chmod o+x)"
                )
        return warnings

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> LocalRunHandle:
        isolation = self._isolation()  # refuses before anything is created
        _refuse_missing_task_env(spec)  # so does a ${VAR} this worker has no value for
        run_dir = RunDir(self.root / spec.batch_id)
        python = self.settings.local_python
        run = run_document(
            spec,
            isolation=isolation,
            python=python,
            rootfs_dir=self.settings.rootfs_dir,
            node=socket.gethostname(),
            redis_url=self.settings.redis_url,
            record_ttl=self.settings.record_ttl,
        )
        run_dir.path.mkdir(parents=True, exist_ok=True)
        for path in (self.root, run_dir.path):
            path.chmod(0o755)  # readable by the sandboxes' host user; written only by us
        key = self.pool_key(spec)
        if key is not None and self._pool_dir(key).socket.exists():
            run["pool_dir"] = str(self._pool_dir(key).path)  # its supervisor takes from it
        write_program(run_dir.program, python)
        # The first start creates run.json; a redelivered start finds it and keeps its origin.
        create_json_exclusive(run_dir.run_file, run)
        existing = run_dir.read_json(run_dir.run_file)
        if (
            not existing
            or existing.get("batch_id") != spec.batch_id
            or existing.get("owner") != OWNER
        ):
            raise OwnershipError(f"{run_dir.path} holds a run that is not batch {spec.batch_id}")
        handle = LocalRunHandle(
            backend=self.name,
            batch_id=spec.batch_id,
            origin=existing["created_at"],
            episode_prefix=existing["episode_prefix"],
            context=f"local:{existing['node']}",
            infra_retries=spec.infra_retries,
            run_dir=str(run_dir.path),
            run_uid=existing["run_uid"],
            isolation=existing["isolation"],
            node=existing["node"],
        )
        record({"run": handle.to_dict()})
        self._ensure_supervisor(run_dir)
        return handle

    def _ensure_supervisor(self, run_dir: RunDir) -> None:
        if run_dir.finished_file.exists():
            return
        try:
            lock = open(run_dir.lock_file, "a+")  # noqa: SIM115 - closed below
        except FileNotFoundError as exc:
            raise BackendError(f"run folder {run_dir.path} is gone") from exc
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a supervisor holds the run
            fcntl.flock(lock, fcntl.LOCK_UN)
        try:
            spawn_detached("rollout_worker.backends.local.supervisor", run_dir.path)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BackendError(f"could not start the local supervisor: {exc}") from exc

    def _done_signal(self) -> DoneSignal:
        if self._signal is None:
            self._signal = DoneSignal.from_url(self.settings.redis_url)
        return self._signal

    def wait_episode(
        self, handle: RunHandle, index: int, timeout: float, *, until_ready: bool = False
    ) -> EpisodeObservation:
        # `until_ready` is moot here: the supervisor streams ready/rewarded from the output.
        run_dir = self._dir(handle)
        end = time.monotonic() + timeout
        while True:
            status = run_dir.read_json(run_dir.status(index))
            if status is not None:
                return EpisodeObservation.from_dict(status)
            if not run_dir.run_file.exists():
                # Deleted (after its report, or cancelled): a late copy of a collect task.
                raise BackendError(f"run folder {run_dir.path} is gone")
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            self._done_signal().wait(handle.batch_id, index, remaining)
        return EpisodeObservation(
            index=index,
            episode_id=handle.episode_id(index),
            phase="Running" if run_dir.log(index).exists() else "Pending",
            node=handle_as(LocalRunHandle, handle).node,
        )

    def wait_ended(
        self, handle: RunHandle, indexes: list[int], timeout: float, *, ready: AbstractSet[int]
    ) -> list[int]:
        # `ready` is moot: the supervisor streams it, so no collector parks until ready.
        run_dir = self._dir(handle)
        end = time.monotonic() + timeout
        while True:
            if not run_dir.run_file.exists():
                return list(indexes)  # deleted: its collectors record that it is gone
            ended = [i for i in indexes if run_dir.status(i).exists()]
            if ended or not indexes:
                return ended
            remaining = end - time.monotonic()
            if remaining <= 0:
                return []
            self._done_signal().wait_any(handle.batch_id, indexes, remaining)

    def resume_run(self, handle: RunHandle) -> None:
        """Revive a supervisor that died mid-run (it reports the episodes it lost as failed
        and goes on with the rest); a no-op while one holds the run or once it finished."""
        self._ensure_supervisor(self._dir(handle))

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        path = self._dir(handle).log(obs.index)
        try:
            with open(path, "rb") as log:
                data = log.read(MAX_LOG_BYTES + len(LOG_CUT_MARK) + 16)
        except FileNotFoundError:
            return ""
        # The supervisor cuts a log at MAX_LOG_BYTES (and says so in it); read no more.
        return data.decode("utf-8", errors="replace")

    def run_status(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        return self.finish_run(spec, handle)  # the run folder is read at once anyway

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        handle = handle_as(LocalRunHandle, handle)
        run_dir = self._dir(handle)
        finished = run_dir.read_json(run_dir.finished_file)
        records: dict[str, str] = {}
        if run_dir.run_file.exists():
            run = orjson.loads(run_dir.run_file.read_bytes())
            records["run.json"] = orjson.dumps(run, option=orjson.OPT_INDENT_2).decode()
        if run_dir.supervisor_log.exists() and run_dir.supervisor_log.stat().st_size:
            records["supervisor.log"] = run_dir.supervisor_log.read_text(errors="replace")
        for index in range(spec.count):
            # The logs of attempts run again under the retry budget (the rows say why).
            for attempt, _ in enumerate(
                (run_dir.read_json(run_dir.attempts(index)) or {}).get("retried", [])
            ):
                path = run_dir.attempt_log(index, attempt)
                if path.exists():
                    text = path.read_bytes()[:MAX_LOG_BYTES].decode("utf-8", "replace")
                    records[f"episode-{index}.attempt{attempt}.log"] = text
        # Like the Job controller: Complete when every episode's sandbox succeeded.
        phases = [
            (run_dir.read_json(run_dir.status(i)) or {}).get("phase") for i in range(spec.count)
        ]
        verdict = RunVerdict.RUNNING
        if finished is not None:
            succeeded = all(p == "Succeeded" for p in phases)
            verdict = RunVerdict.COMPLETE if succeeded else RunVerdict.FAILED
        return FinishedRun(
            records=records,
            completed_at=finished.get("finished_at") if finished else None,
            verdict=verdict,
            facts={"isolation": handle.isolation, "run_dir": handle.run_dir},
        )

    def cancel_run(self, handle: RunHandle) -> None:
        # The supervisor kills the running sandboxes, marks the rest Stopped and exits: wait
        # for that (a few seconds at most), so nothing of the batch runs after this returns.
        self._stop_supervisor(self._dir(handle), wait=CANCEL_WAIT_SECONDS)

    def list_runs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.iterdir()):
            run = RunDir(path).read_json(RunDir(path).run_file) if path.is_dir() else None
            if run and run.get("owner") == OWNER:
                found.append(str(run.get("batch_id")))
        return found

    def _signal_supervisor(self, run_dir: RunDir) -> int | None:
        """SIGTERM the run's supervisor, once its process is proven to be that supervisor (a
        stale pid file may name a reused pid)."""
        try:
            pid = int(run_dir.pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        if str(run_dir.path).encode() not in cmdline:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        return pid

    def delete_run(self, handle: RunHandle) -> bool:
        run_dir = self._dir(handle)
        root = self.root.resolve()
        path = run_dir.path.resolve()
        if root not in path.parents:
            raise OwnershipError(f"refusing to delete {path}: it is not under {root}")
        run_uid = handle_as(LocalRunHandle, handle).run_uid
        # The run is renamed to this before it is removed: a deletion cut short (its worker
        # killed mid-rmtree, run.json perhaps gone already) resumes by a name that only a run
        # proven ours was given.
        doomed = root / f".deleting-{path.name}-{run_uid}"
        run = run_dir.read_json(run_dir.run_file)
        if run is None:
            if path.exists():
                raise OwnershipError(f"refusing to delete {path}: it has no run.json of ours")
            shutil.rmtree(doomed, ignore_errors=True)
            return True  # already gone
        if run.get("owner") != OWNER or run.get("run_uid") != run_uid:
            raise OwnershipError(
                f"refusing to delete {path}: its owner/run_uid ({run.get('owner')}, "
                f"{run.get('run_uid')}) do not match the receipt ({OWNER}, {run_uid})"
            )
        self._stop_supervisor(run_dir)
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        shutil.rmtree(doomed)
        return True

    def _stop_supervisor(self, run_dir: RunDir, wait: float = 10.0) -> None:
        pid = self._signal_supervisor(run_dir)
        if pid is None:
            return
        end = time.monotonic() + wait
        with open(run_dir.lock_file, "a+") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return  # nobody holds the run any more
                except BlockingIOError:
                    pass
                if time.monotonic() > end:
                    raise BackendError(f"local supervisor {pid} did not stop within {wait:.0f}s")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                time.sleep(0.05)

    # -- warm pools (local/pool.py) -------------------------------------------------
    def _pool_dir(self, key: str) -> PoolDir:
        # "_pools" can never be a batch id (no underscore in those): no run folder collides.
        return PoolDir(self.root / "_pools" / key)

    def pool_key(self, spec: BatchSpec) -> str | None:
        """Pools need bwrap: only bwrap reports the exit code of a sandbox whose parent is the
        pool process, not the run's supervisor."""
        if self._isolation() != "bwrap":
            return None
        python = self.settings.local_python
        return warm.pool_key(spec, f"{episode_program_text()}|bwrap|{python}")

    def fill_pool(
        self, spec: BatchSpec, size: int, budget: int, idle_seconds: float, record: ReceiptUpdate
    ) -> dict[str, int]:
        key = self.pool_key(spec)
        if key is None:
            raise BackendError(
                "no local warm pool for this batch: it needs bwrap isolation, one image and "
                "no retry budget"
            )
        pool_dir = self._pool_dir(key)
        record({"pool_dir": str(pool_dir.path)})
        pool_dir.path.mkdir(parents=True, exist_ok=True)
        for path in (self.root, pool_dir.path.parent, pool_dir.path):
            path.chmod(0o755)  # the sandboxes' host user passes through to their own folders
        others = sum(
            (pool_dir.read(other.state) or {}).get("waiting", 0)
            for other in map(PoolDir, pool_dir.path.parent.iterdir())
            if other.path != pool_dir.path
        )
        size = max(0, min(size, budget - others))
        existing = pool_dir.read(pool_dir.config) or {}
        uid = existing.get("uid") or uuid.uuid4().hex
        python = self.settings.local_python
        prefix, _ = describe_python(python)
        memory_bytes, cpu_seconds = sandbox_limits(spec.resources, spec.episode_timeout_seconds)
        write_program(pool_dir.program, python)
        write_json_atomic(
            pool_dir.config,
            {
                "owner": OWNER,
                "key": key,
                "uid": uid,
                "size": size,
                "idle_seconds": idle_seconds,
                "python": python,
                "python_prefix": prefix,
                "limits": {
                    "memory_bytes": memory_bytes,
                    "cpu_seconds": cpu_seconds,
                    "storage_bytes": storage_bytes(spec.resources),
                },
            },
        )
        record({"uid": uid})
        if pool_dir.alive():
            with contextlib.suppress(OSError):
                ask(pool_dir, {"fill": True})
                return {"size": size, "started": 0}
        try:
            spawn_detached("rollout_worker.backends.local.pool", pool_dir.path)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BackendError(f"could not start the local pool: {exc}") from exc
        return {"size": size, "started": 1}

    def drain_pool(self, key: str, namespace_uid: str | None) -> bool:
        pool_dir = self._pool_dir(key)
        config = pool_dir.read(pool_dir.config)
        if config is None:
            return True
        if config.get("owner") != OWNER or (namespace_uid and config.get("uid") != namespace_uid):
            raise OwnershipError(
                f"{pool_dir.path} holds pool uid {config.get('uid')}, the registry says "
                f"{namespace_uid}: refusing to delete it"
            )
        if pool_dir.alive():
            with contextlib.suppress(OSError):
                ask(pool_dir, {"drain": True})
            return False
        shutil.rmtree(pool_dir.path, ignore_errors=True)
        return True

    def list_pools(self) -> dict[str, dict[str, Any]]:
        root = self.root / "_pools"
        pools: dict[str, dict[str, Any]] = {}
        for path in sorted(root.iterdir()) if root.is_dir() else []:
            pool_dir = PoolDir(path)
            config = pool_dir.read(pool_dir.config)
            if not config or config.get("owner") != OWNER:
                continue
            state = pool_dir.read(pool_dir.state) or {} if pool_dir.alive() else {}
            pools[path.name] = {
                "namespace": str(path),
                "uid": config.get("uid"),
                "waiting": state.get("waiting", 0),
                "claimed_running": state.get("handed", 0),
                "pods": state.get("waiting", 0) + state.get("handed", 0),
            }
        return pools


def _refuse_missing_task_env(spec: BatchSpec) -> None:
    """A task's ${VAR} (no default) that this worker's environment lacks refuses the batch:
    the supervisor it starts inherits this environment and resolves the templates from it
    when each sandbox starts, so an episode would otherwise run without the variable."""
    missing = missing_task_env(spec.tasks, lambda name: name in os.environ)
    if missing:
        raise BackendUnavailable(
            "; ".join(missing) + " (set it in the workers' environment, or give it a default: "
            "${VAR:-default})"
        )
