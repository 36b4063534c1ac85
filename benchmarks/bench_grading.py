"""What grading costs, before and after a change to the episode program (not a test): the
bundled tasks (without `palindrome`, whose scripted timeouts only add waiting) through real
local sandboxes and the scripted policy, the same batch with the program of `--before` (a git
revision) and with this checkout's, alternating in each round.

Per batch: the sandboxes' CPU-seconds per episode (a cgroup around the supervisor, as
bench_rollouts), grading seconds per episode (the rows' `cost.wall.tests`, from the agent's
end to the reward) and the rewards per (task, sample), which must agree between the two.

    python -m benchmarks.bench_grading [--before 6a3ec8d] [--rounds 3] [--samples 8]

`--before` may name a revision from before or after the runner became a package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from benchmarks.bench_rollouts import CPUACCT, run
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.backends.local.backend import LocalBackend
from rollout_worker.cli.policy_server import running
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def batch(backend: LocalBackend, url: str, program: str, name: str, samples: int) -> dict:
    tasks = [t for t in bundled_tasks() if t["id"] != "palindrome"]
    request = {
        "tasks": tasks,
        "samples_per_task": samples,
        "parallelism": 4,
        "deadline_seconds": 3600,
        "policy": {"url": url, "request_timeout_seconds": 10},
    }
    rows: list[Any] = []
    figures = run(backend, request, name, program=program, rows_out=rows)
    grading = [r.cost["wall"]["tests"] for r in rows if r.cost and r.cost["wall"].get("tests")]
    figures["grading_seconds_per_episode"] = round(statistics.median(grading), 4)
    figures["rewards"] = {f"{r.task_id}/{r.sample}": r.reward for r in rows}
    return figures


def program_at(revision: str) -> str:
    """The episode program of a git revision: its one file (before the runner became a
    package), or what that revision's package builds."""
    shown = subprocess.run(
        ["git", "show", f"{revision}:rollout_worker/sandbox/episode.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if shown.returncode == 0:
        return shown.stdout
    with tempfile.TemporaryDirectory(prefix="rollout-before-") as tree:
        archive = subprocess.run(
            ["git", "archive", revision, "rollout_worker", "rollout_wire"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        build = "import sys; from rollout_worker.sandbox import episode_program_text as p; "
        build += "sys.stdout.write(p())"
        return subprocess.run(
            [sys.executable, "-c", build],
            cwd=tree,
            env=dict(os.environ, PYTHONPATH=tree),
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="6a3ec8d")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    if not (CPUACCT / "cpuacct.usage").exists() or os.geteuid() != 0:
        sys.exit("needs root and a cgroup v1 cpuacct hierarchy at /sys/fs/cgroup/cpuacct")
    programs = {"before": program_at(args.before), "after": episode_program_text()}
    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    backend = LocalBackend(Settings(local_root=root, redis_url="redis://127.0.0.1:9/0"))
    backend._ensure_supervisor = lambda run_dir: None  # type: ignore[method-assign]
    results: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        with running() as server:
            for number in range(args.rounds):
                order = ("before", "after") if number % 2 == 0 else ("after", "before")
                for name in order:
                    figures = batch(backend, server.url, programs[name], name, args.samples)
                    results[name].append(figures)
                    shown = {k: v for k, v in figures.items() if k != "rewards"}
                    sys.stdout.write(orjson.dumps({"round": number, **shown}).decode() + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {}
    for key in ("cpu_seconds_per_episode", "grading_seconds_per_episode", "wall_seconds"):
        for name in ("before", "after"):
            values = sorted(f[key] for f in results[name])
            summary[f"{name}_{key}"] = [values[len(values) // 2], values[0], values[-1]]
        ratios = [a[key] / b[key] for a, b in zip(results["after"], results["before"], strict=True)]
        summary[f"after/before_{key}"] = round(statistics.median(ratios), 3)
    summary["rewards_agree"] = all(
        a["rewards"] == b["rewards"]
        for a, b in zip(results["after"], results["before"], strict=True)
    )
    summary["reward_sum"] = {n: [sum(f["rewards"].values()) for f in results[n]] for n in results}
    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")


if __name__ == "__main__":
    main()
