"""Real rollouts vs the guide's demo on the local backend (not a test): episodes per second and
CPU per episode for one batch of N episodes.

- demo: N episodes of the built-in task with the fixed action.
- mixed: the bundled task set without `palindrome` (its scripted timeouts only add waiting),
  N / 8 samples per task, the scripted policy in this process.

The supervisor runs as a child of this process inside a cgroup (v1 cpuacct, needs root) so the
CPU of every sandbox it starts is counted (bubblewrap's PID namespaces hide them from
/usr/bin/time's rusage); the policy server's CPU is this process's own.

    python -m benchmarks.bench_rollouts [--episodes 200] [--parallelism 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from rollout_wire.request import parse_spec
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.backends.local.backend import LocalBackend
from rollout_worker.backends.local.files import RunDir
from rollout_worker.cli.policy_server import running
from rollout_worker.sandbox import compile_program
from rollout_worker.settings import Settings
from rollout_worker.validation import validate_episode

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def run(
    backend: LocalBackend,
    request: dict[str, Any],
    name: str,
    program: str | None = None,
    rows_out: list[Any] | None = None,
) -> dict[str, Any]:
    """One batch's figures; `program` replaces the episode program the run got (another
    version's, for an A/B), `rows_out` receives its validated rows."""
    spec = parse_spec(request, max_episodes=100_000)
    handle = backend.start_run(spec, lambda fields: None)
    if program is not None:
        assert handle.run_dir is not None
        source = RunDir(Path(handle.run_dir)).program
        source.write_text(program)
        compile_program(source, backend.settings.local_python)  # as the checkout's own
    cgroup = CPUACCT / f"rollout-bench-{os.getpid()}-{name}"
    cgroup.mkdir()
    try:

        def enter() -> None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

        started = time.time()
        module = "rollout_worker.backends.local.supervisor"
        assert handle.run_dir is not None
        subprocess.run([sys.executable, "-m", module, handle.run_dir], preexec_fn=enter, check=True)
        wall = time.time() - started
        cpu = int((cgroup / "cpuacct.usage").read_text()) / 1e9
    finally:
        cgroup.rmdir()
    rows = []
    for index in range(spec.count):
        obs = backend.wait_episode(handle, index, 5)
        rows.append(validate_episode(obs, backend.read_output(handle, obs), handle.origin))
    backend.delete_run(handle)
    if rows_out is not None:
        rows_out.extend(rows)
    return {
        "batch": name,
        "episodes": spec.count,
        "ok": sum(r.ok for r in rows),
        "reward_sum": round(sum(r.reward for r in rows), 3),
        "policy_steps": sum(r.steps or 0 for r in rows),
        "wall_seconds": round(wall, 1),
        "episodes_per_second": round(spec.count / wall, 2),
        "cpu_seconds": round(cpu, 1),
        "cpu_seconds_per_episode": round(cpu / spec.count, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--parallelism", type=int, default=10)
    args = parser.parse_args()
    if not (CPUACCT / "cpuacct.usage").exists() or os.geteuid() != 0:
        sys.exit("needs root and a cgroup v1 cpuacct hierarchy at /sys/fs/cgroup/cpuacct")
    root = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    backend = LocalBackend(Settings(local_root=root, redis_url="redis://127.0.0.1:9/0"))
    backend._ensure_supervisor = lambda run_dir: None  # type: ignore[method-assign]
    try:
        demo = run(backend, {"count": args.episodes, "parallelism": args.parallelism}, "demo")
        tasks = [t for t in bundled_tasks() if t["id"] != "palindrome"]
        with running() as server:
            before = resource.getrusage(resource.RUSAGE_SELF)
            request = {
                "tasks": tasks,
                "samples_per_task": max(1, args.episodes // len(tasks)),
                "parallelism": args.parallelism,
                "deadline_seconds": 3600,
                "policy": {"url": server.url, "request_timeout_seconds": 10},
            }
            mixed = run(backend, request, "mixed")
            after = resource.getrusage(resource.RUSAGE_SELF)
        policy_cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
        mixed["policy_server_cpu_seconds"] = round(policy_cpu, 2)
        for figures in (demo, mixed):
            sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
