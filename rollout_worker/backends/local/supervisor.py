"""The local stand-in for the Job controller: runs one batch's episodes as sandboxed processes.

Started detached by the local backend (`python -m rollout_worker.backends.local.supervisor
--daemonize RUN_DIR`); it outlives the Celery task that started it. It holds an exclusive lock
on the run for its lifetime, so a second start is a no-op, and it skips episodes that already
have a status, so a restart never runs an episode twice.

Beside it: `output` (a running sandbox and its log), `phases` (an agent's episode graded in a
second sandbox), `reporter` (progress to Redis), `sandbox` (the bwrap command line).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollout_wire.request import BatchSpec
from rollout_wire.tasksets import demo_task
from rollout_worker.backends.local.disk import DiskWatch, over_limit
from rollout_worker.backends.local.files import (
    RunDir,
    TreeCopy,
    copy_tree,
    daemonize,
    resolve_in_root,
    write_json_atomic,
)
from rollout_worker.backends.local.output import (
    GRADE_PENDING_LINE,
    READY_LINE,
    REWARD_LINE,
    Running,
    error_cause,
    read_output,
)
from rollout_worker.backends.local.phases import (
    AGENT_PHASE,
    GRADE_PHASE,
    agent_task,
    baseline_tests,
    hidden_steps_mount,
    phase_env,
    secret_fd,
    state_mounts,
    state_phase,
    task_env_values,
    two_sandboxes,
)
from rollout_worker.backends.local.policy_proxy import EpisodeIdentity, PolicyProxy
from rollout_worker.backends.local.pool import exit_code
from rollout_worker.backends.local.reporter import Reporter
from rollout_worker.backends.local.sandbox import (
    ImageRoot,
    Mount,
    SandboxPlan,
    plan_sandbox,
    rlimits,
)
from rollout_worker.backends.local.warm_start import take_warm
from rollout_worker.observation import EXIT_INFRASTRUCTURE


class Supervisor:
    def __init__(self, run_dir: RunDir) -> None:
        self.dir = run_dir
        run = run_dir.read_json(run_dir.run_file)
        if run is None:
            raise SystemExit(f"no run.json in {run_dir.path}")
        self.run = run
        spec = BatchSpec.from_dict(run["spec"])
        self.spec = spec
        self.count = spec.count
        self.parallelism = spec.parallelism
        self.action = spec.action
        self.origin: float = run["created_at"]
        self.run_deadline = self.origin + spec.deadline_seconds
        self.episode_timeout = spec.episode_timeout_seconds
        # Worked out by the worker from the spec's resources (see quantities.sandbox_limits).
        self.memory_bytes: int = run["limits"]["memory_bytes"]
        self.cpu_seconds: int = run["limits"]["cpu_seconds"]
        # The episode's disk, measured (local/disk.py); a run.json from before: the old 1Gi.
        self.storage_bytes: int = run["limits"].get("storage_bytes", 2**30)
        self.disk = DiskWatch()
        self.running: dict[int, Running] = {}
        self.pending: deque[int] = deque()
        self.pool_empty = False  # its warm pool stopped answering: every start is cold
        # Earlier attempts of episodes run again under the retry budget (kept on disk too: a
        # supervisor started again after a crash knows which attempt comes next).
        self.retried: dict[int, list[dict[str, Any]]] = {}
        # Each agent sandbox's baseline counts (its grade_pending), for its grader's start.
        self.baselines: dict[int, str] = {}
        for index in range(self.count):
            earlier = run_dir.read_json(run_dir.attempts(index))
            if earlier:
                self.retried[index] = list(earlier["retried"])
        self.selector = selectors.DefaultSelector()
        self.stopping = False
        self.as_root = os.geteuid() == 0
        self.progress = Reporter(run.get("progress"))
        # Real rollouts: the policy is reached through a per-episode socket (no network in the
        # sandbox); each episode sees only its own task.
        self.proxy: PolicyProxy | None = None
        self.real = spec.policy is not None or bool(spec.tasks)
        self.runner_policy = "{}"  # an oracle-only batch asks no policy
        if spec.policy is not None:
            # A little longer than the runner waits, so the runner's own timeout decides.
            self.proxy = PolicyProxy(spec.policy, float(spec.policy.request_timeout_seconds) + 5)
            self.runner_policy = spec.policy.runner_json()
        if self.real:
            for position, task in enumerate(spec.tasks or [demo_task()]):
                # The agent's sandbox never holds what it must not see: the tests (and the
                # solution, but for the oracle); the grader's gets the whole task.
                write_json_atomic(self.task_file(position), [agent_task(task)])
                write_json_atomic(self.task_file(position, GRADE_PHASE), [task])

    def task_file(self, position: int, phase: str = AGENT_PHASE) -> Path:
        suffix = "" if phase == AGENT_PHASE else f".{phase}"
        return self.dir.path / "tasks" / f"{position}{suffix}.json"

    def state_dir(self, index: int, phase: str) -> Path:
        """An episode's /tmp, /logs, /tests and /solution, kept beside its workspace."""
        return self.dir.workspace(index).parent / f"{index}.{phase}"

    def task_of(self, index: int) -> Mapping[str, Any]:
        """Episode `index`'s task ({} for the guide's demo, which has none)."""
        if not self.spec.tasks:
            return {}
        return self.spec.tasks[self.spec.episode(index).task_index or 0]

    def image_root(self, index: int) -> ImageRoot | None:
        """The task's image as the sandbox's root, when the task is only its image (a Harbor
        Dockerfile) and its root filesystem was exported (the backend checked it was)."""
        if not self.spec.tasks or self.run["isolation"] != "bwrap":
            return None
        task = self.spec.tasks[self.spec.episode(index).task_index or 0]
        if not task.get("image") or task.get("files"):
            return None
        return ImageRoot.find(Path(self.run.get("rootfs_dir") or ""), task["image"])

    def agent_setup(
        self, index: int, phase: str = AGENT_PHASE
    ) -> tuple[dict[str, str], list[Mount], Path | None]:
        """The runner's environment, mounts and /tmp for episode `index` (none for the demo)."""
        if not self.real:
            return {}, [], None
        episode = self.spec.episode(index)
        attempt = self.attempt(index)
        identity = EpisodeIdentity(
            self.episode_id(index), episode.group_id, episode.task_id, episode.sample, attempt
        )
        env = {
            "ROLLOUT_POLICY": self.runner_policy,
            "ROLLOUT_ATTEMPT": str(attempt),
            "ROLLOUT_TASK_ID": episode.task_id,
            "ROLLOUT_SAMPLE": str(episode.sample),
            "ROLLOUT_GROUP_ID": episode.group_id,
        }
        position = episode.task_index or 0
        mounts = [
            Mount(self.task_file(position, phase), "/sandbox/tasks.json", "ROLLOUT_TASKS_FILE")
        ]
        if self.proxy is not None and phase == AGENT_PHASE:  # the grader asks no policy
            sock = self.proxy.open(index, identity)
            mounts.append(Mount(sock, "/sandbox/policy.sock", "ROLLOUT_POLICY_SOCKET"))
        if self.spec.agent_env:
            mounts.append(Mount(Path(self.spec.agent_env), self.spec.agent_env, ""))
        task: Mapping[str, Any] = self.spec.tasks[position] if self.spec.tasks else {}
        if not two_sandboxes(task):
            return env, mounts, None
        baseline = self.baselines.pop(index, "null") if phase == GRADE_PHASE else None
        env |= phase_env(task, phase, baseline)
        state = self.state_dir(index, state_phase(task, phase))
        mounts += state_mounts(state, self.as_root) + hidden_steps_mount(task, state, self.as_root)
        return env, mounts, state / "tmp"

    def attempt(self, index: int) -> int:
        return len(self.retried.get(index, ()))

    def episode_id(self, index: int) -> str:
        """A fresh sandbox name per attempt, like a Job's replacement Pod."""
        attempt = self.attempt(index)
        suffix = f"-retry{attempt}" if attempt else ""
        return f"{self.run['episode_prefix']}-{index}{suffix}"

    def status_fields(self, index: int, **fields: Any) -> dict[str, Any]:
        """Episode `index`'s end, as its status file holds it."""
        return {
            "index": index,
            "episode_id": self.episode_id(index),
            "node": self.run["node"],
            "image_id": self.run["image_id"],
            "restart_count": 0,
            "retried": self.retried.get(index, []),
        } | fields

    def write_status(self, index: int, **fields: Any) -> None:
        write_json_atomic(self.dir.status(index), self.status_fields(index, **fields))
        self.progress(index, "done")

    def todo(self) -> deque[int]:
        pending = self.pending
        for index in range(self.count):
            if self.dir.status(index).exists():
                continue
            if self.dir.log(index).exists():
                # A previous supervisor died mid-episode: report it, never rerun it silently.
                self.write_status(
                    index,
                    phase="Failed",
                    reason="SupervisorLost",
                    exit_code=None,
                    finished_at=time.time(),
                )
                continue
            pending.append(index)
        return pending

    def start(self, index: int, phase: str = AGENT_PHASE, since: float | None = None) -> None:
        """Start episode `index`'s sandbox; the grading phase (`since`: when the agent's
        started) grades the workspace the agent left, or a copy of it (`fresh`)."""
        workspace = self.dir.workspace(index)
        # Harbor's [environment] workdir: the folder the agent and its tests run in (in an
        # image, that folder's own files are the workspace, as for its WORKDIR).
        workdir = self.task_of(index).get("workdir")
        root = self.image_root(index)
        if root is not None and workdir:
            root = replace(root, workdir=workdir)
        if root is not None and root.workdir != "/":
            try:
                # root.path is on the host: a WORKDIR that is a link (to /, to /etc) is
                # followed inside the image's filesystem only.
                root = replace(root, workdir=resolve_in_root(root.path, root.workdir))
            except ValueError as exc:
                self.refuse_start(index, exc)
                return
        self.prepare_workspace(index, phase)
        extra_env, mounts, tmp = self.agent_setup(index, phase)
        if root is not None and phase == AGENT_PHASE and root.workdir != "/":
            # The episode starts from the image's working directory, a copy of its own.
            shutil.rmtree(workspace)
            image_workdir = root.path / root.workdir.lstrip("/")
            _note_copy(index, "the image's WORKDIR", copy_tree(image_workdir, workspace))
        plan = plan_sandbox(
            isolation=self.run["isolation"],
            python=self.run["python"],
            python_prefix=self.run["python_prefix"],
            program=self.dir.program,
            workspace=workspace,
            episode_id=self.episode_id(index),
            action=self.action,
            running_as_root=self.as_root,
            extra_env=extra_env,
            mounts=mounts,
            tmp=tmp,
            root=root,
            workdir=workdir if root is None else None,
            secret_env=task_env_values(self.task_of(index), phase, os.environ),
            disable_userns=bool(self.run.get("disable_userns")),
        )
        if plan.run_as:
            for folder, _, files in os.walk(workspace):
                os.chown(folder, *plan.run_as)
                for name in files:
                    os.chown(os.path.join(folder, name), *plan.run_as, follow_symlinks=False)
        self.launch(index, phase, plan, time.time() if since is None else since)

    def refuse_start(self, index: int, exc: ValueError) -> None:
        """End an episode that cannot start: its files go, its end says why (StartError)."""
        print(f"episode {index}: not started: {exc}", flush=True)
        for own in (AGENT_PHASE, GRADE_PHASE):
            shutil.rmtree(self.state_dir(index, own), ignore_errors=True)
        shutil.rmtree(self.dir.workspace(index), ignore_errors=True)
        self.write_status(
            index,
            phase="Failed",
            reason="StartError",
            exit_code=None,
            finished_at=time.time(),
        )

    def prepare_workspace(self, index: int, phase: str) -> None:
        """An agent starts from an empty workspace; a `fresh` grader from a copy of what the
        agent left (a `same` one from what it left)."""
        workspace = self.dir.workspace(index)
        if phase == AGENT_PHASE:
            shutil.rmtree(workspace, ignore_errors=True)
            workspace.mkdir(parents=True)
        elif self.task_of(index).get("grade") == "fresh":
            agent_left = workspace.with_name(f"{index}.left")
            workspace.rename(agent_left)
            # What the agent left is hostile: copied on the host without following a link
            # or opening a FIFO, socket or device, and bounded; its grader sees the copy.
            _note_copy(index, "the agent's workspace", copy_tree(agent_left, workspace))
            shutil.rmtree(agent_left, ignore_errors=True)

    def launch(self, index: int, phase: str, plan: SandboxPlan, created_at: float) -> None:
        """Start the planned sandbox under its limits, its stdout to the episode's log."""
        self.dir.log(index).parent.mkdir(parents=True, exist_ok=True)
        # The grader's events follow the agent's in the episode's one log.
        log = (  # closed in finish()
            open(self.dir.log(index), "wb")  # noqa: SIM115
            if phase == AGENT_PHASE
            else open(self.dir.log(index), "ab")  # noqa: SIM115
        )
        secrets = secret_fd(plan)
        with open(self.dir.stderr(index), "wb") as err:
            proc = subprocess.Popen(
                plan.argv_with_secrets(secrets) if secrets is not None else plan.argv,
                pass_fds=() if secrets is None else (secrets,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=plan.cwd,
                env=plan.env,
                start_new_session=True,
                preexec_fn=rlimits(self.memory_bytes, self.cpu_seconds, self.storage_bytes),
                user=plan.run_as[0] if plan.run_as else None,
                group=plan.run_as[1] if plan.run_as else None,
                extra_groups=[] if plan.run_as else None,
            )
        if secrets is not None:
            os.close(secrets)
        assert proc.stdout is not None
        out = proc.stdout.fileno()
        os.set_blocking(out, False)
        pidfd = os.pidfd_open(proc.pid)
        deadline = min(created_at + self.episode_timeout, self.run_deadline)
        written = self.dir.log(index).stat().st_size if phase == GRADE_PHASE else 0
        self.track(
            Running(
                index,
                proc,
                pidfd,
                out,
                log,
                created_at,
                self.attempt(index),
                deadline,
                written=written,
                phase=phase,
            )
        )

    def track(self, item: Running) -> None:
        """Follow a started sandbox: its exit (pidfd) and its output."""
        self.running[item.pidfd] = item
        # With itself: a host agent's selector follows the sandboxes of several runs.
        self.selector.register(item.pidfd, selectors.EVENT_READ, ("exit", item, self))
        self.selector.register(item.out, selectors.EVENT_READ, ("out", item, self))
        self.progress(item.index, "running")

    def take_warm(self) -> None:
        take_warm(self)

    def read_output(self, item: Running) -> bool:
        """Copy what the sandbox printed into its log; stream progress. False at EOF."""
        lines = read_output(item)
        if lines is None:
            return False
        for line in lines:
            if READY_LINE in line:
                self.progress(item.index, "ready")
            elif REWARD_LINE in line:
                self.progress(item.index, "rewarded")
            elif GRADE_PENDING_LINE in line:
                item.grade_pending = True
                self.baselines[item.index] = baseline_tests(line)
        return True

    def finish(self, item: Running) -> None:
        item.done = True
        self.selector.unregister(item.pidfd)
        os.close(item.pidfd)
        del self.running[item.pidfd]
        # The sandbox is gone (its PID namespace with it): drain what is left in the pipe.
        with contextlib.suppress(KeyError):  # unregistered already if EOF came first
            self.selector.unregister(item.out)
        os.set_blocking(item.out, True)
        while self.read_output(item):
            pass
        item.log.close()
        if self.proxy is not None:
            self.proxy.close(item.index)
        if item.warm is not None:
            os.close(item.out)
            with contextlib.suppress(OSError):  # the sandbox's stderr, kept with the run's
                shutil.copyfile(item.warm.workspace.parent / "stderr", self.dir.stderr(item.index))
            warm_code = exit_code(item.warm.status)
            os.close(item.warm.status)
            # No status from bwrap: bwrap itself was killed (by us, or with its pool).
            code = warm_code if warm_code is not None else -signal.SIGKILL
        else:
            assert item.proc is not None and item.proc.stdout is not None
            item.proc.stdout.close()
            code = item.proc.wait()
        finished_at = time.time()
        if item.killed_for is None:  # past its disk limit since the last measurement
            item.killed_for = over_limit(self.folders(item), self.storage_bytes)
        if self.retry(item, code, finished_at):
            return
        if (
            item.phase == AGENT_PHASE
            and item.grade_pending
            and code == 0
            and item.killed_for is None
            and not self.stopping
        ):
            self.start(item.index, GRADE_PHASE, since=item.created_at)
            return
        reason = item.killed_for
        if reason is None and code < 0:
            reason = f"Signal{-code}"
        elif reason is None and code != 0:
            reason = "Error"
        # The sandbox's files go before its end is published: whoever sees the end sees them
        # gone (a status first let a reader find the workspace still there).
        shutil.rmtree(
            item.warm.workspace.parent if item.warm else self.dir.workspace(index=item.index),
            ignore_errors=True,
        )
        for phase in (AGENT_PHASE, GRADE_PHASE):
            shutil.rmtree(self.state_dir(item.index, phase), ignore_errors=True)
        self.write_status(
            item.index,
            phase="Succeeded" if code == 0 and item.killed_for is None else "Failed",
            reason=reason,
            exit_code=code if code >= 0 else 128 - code,
            created_at=item.created_at,
            started_at=item.created_at,
            finished_at=finished_at,
            timing={
                "queue_seconds": item.created_at - self.origin,
                "run_seconds": finished_at - item.created_at,
                **({"pool_created_at": item.warm.created_at} if item.warm else {}),
            },
            policy_completions=self.proxy.answered(item.index) if self.proxy is not None else None,
            **({"sandbox": item.warm.name} if item.warm else {}),
        )

    def folders(self, item: Running) -> list[Path]:
        """The episode's folders on disk, which its disk limit bounds (local/disk.py)."""
        if item.warm is not None:
            return [item.warm.workspace.parent]
        states = (self.state_dir(item.index, phase) for phase in (AGENT_PHASE, GRADE_PHASE))
        return [self.dir.workspace(item.index), *states]

    def check_disk(self, now: float) -> None:
        """End each running episode whose folders hold more than its disk limit."""
        if not self.running or not self.disk.due(now):
            return
        started = time.monotonic()
        for item in list(self.running.values()):
            why = over_limit(self.folders(item), self.storage_bytes)
            if why is not None:
                item.kill(why)
        self.disk.measured(started)

    def retry(self, item: Running, code: int, finished_at: float) -> bool:
        """Run the episode again in a fresh sandbox when its runner failed for infrastructure
        reasons and the batch's retry budget for it is not spent; keep the attempt's log."""
        if (
            code != EXIT_INFRASTRUCTURE
            or item.killed_for is not None
            or self.stopping
            or self.attempt(item.index) >= self.spec.infra_retries
            or finished_at >= self.run_deadline
        ):
            return False
        index, attempt = item.index, item.attempt
        self.dir.log(index).rename(self.dir.attempt_log(index, attempt))
        with contextlib.suppress(FileNotFoundError):
            self.dir.stderr(index).rename(self.dir.attempt_log(index, attempt, "err"))
        summary = {
            "episode_id": self.episode_id(index),
            "exit_code": code,
            "reason": "Error",
            "cause": error_cause(self.dir.attempt_log(index, attempt)),
            "finished_at": finished_at,
        }
        self.retried.setdefault(index, []).append(summary)
        write_json_atomic(self.dir.attempts(index), {"retried": self.retried[index]})
        shutil.rmtree(self.dir.workspace(index), ignore_errors=True)
        self.pending.appendleft(index)
        return True

    def loop(self) -> None:
        pending = self.todo()
        while pending or self.running:
            self.tick(time.time())
            next_deadline = min([self.run_deadline, *(r.deadline for r in self.running.values())])
            timeout = max(0.0, min(next_deadline - time.time(), 1.0))
            for key, _ in self.selector.select(timeout if self.running else 0):
                kind, item, _ = key.data
                self.dispatch(kind, item)
        if self.proxy is not None:
            self.proxy.close_all()
        write_json_atomic(self.dir.finished_file, {"finished_at": time.time()})

    def tick(self, now: float) -> None:
        """One look at the run: stop or deadline, disk, starts into free slots, kills."""
        pending = self.pending
        if self.stopping or now >= self.run_deadline:
            why = "Stopped" if self.stopping else "DeadlineExceeded"
            for item in list(self.running.values()):
                item.kill(why)
            while pending:
                self.write_status(
                    pending.popleft(),
                    phase="Failed",
                    reason=why,
                    exit_code=None,
                    finished_at=now,
                )
        self.check_disk(now)
        self.take_warm()
        while pending and len(self.running) < self.parallelism:
            self.start(pending.popleft())
        for item in list(self.running.values()):
            if now >= item.deadline:
                item.kill("DeadlineExceeded")

    def dispatch(self, kind: str, item: Running) -> None:
        """One selector event of a sandbox: its exit, or output to copy."""
        if item.done:
            return  # its exit was handled earlier in this same batch of events
        if kind == "exit":
            self.finish(item)
        elif not self.read_output(item):
            self.selector.unregister(item.out)  # EOF before exit: wait for the exit

    def request_stop(self, *_: object) -> None:
        self.stopping = True


def _note_copy(index: int, what: str, copied: TreeCopy) -> None:
    """Into the supervisor's log (a run record): what a copy skipped or where it stopped."""
    note = copied.summary()
    if note:
        print(f"episode {index}: copying {what}: {note}", flush=True)


def serve(path: Path) -> int:
    run_dir = RunDir(path)
    lock = open(run_dir.lock_file, "a+")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another supervisor owns this run
    if run_dir.finished_file.exists():
        return 0
    run_dir.pid_file.write_text(str(os.getpid()))
    supervisor = Supervisor(run_dir)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    supervisor.loop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--daemonize", action="store_true")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if args.daemonize and not daemonize(args.run_dir / "supervisor.log"):
        return 0
    return serve(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
