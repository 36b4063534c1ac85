"""What grading costs, before and after a change to the episode program (not a test): the
bundled tasks (without `palindrome`, whose scripted timeouts only add waiting) through real
local sandboxes and the scripted policy, the same batch with the program of `--before` (a git
revision) and with this checkout's, alternating in each round.

Per batch: the sandboxes' CPU-seconds per episode (a cgroup around the supervisor, as
bench_rollouts), grading seconds per episode (the rows' `cost.wall.tests`, from the agent's
end to the reward), the sandboxes' own CPU-seconds per episode (each row's ledger: runner,
agent commands and tests, without the supervisor's and the kernel's share) and the rewards
per (task, sample), which must agree between the two.

    python -m benchmarks.bench_grading [--before 6a3ec8d] [--rounds 3] [--samples 8]

`--before` may name a revision from before or after the runner became a package.

`--real-node`: the same batches as Pods on the local cluster's real node, through real Celery
workers (two stacks, one per program, alternating), and the CPU per episode from each row's
cost ledger (the Pod's own cgroup: runner, agent and tests) instead of a cgroup around a
supervisor. A worker takes the other program through a `sitecustomize` on its PYTHONPATH
(benchmarks/program_swap/) that replaces `episode_program_text` before the backend reads it:
a benchmark's seam, nothing the product has.

    python -m benchmarks.bench_grading --real-node [--before 6a3ec8d] [--rounds 3] [--samples 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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


SWAP = Path(__file__).resolve().parent / "program_swap"


def request_of(url: str, samples: int) -> dict[str, Any]:
    return {
        "tasks": [t for t in bundled_tasks() if t["id"] != "palindrome"],
        "samples_per_task": samples,
        "parallelism": 4,
        "deadline_seconds": 3600,
        "policy": {"url": url, "request_timeout_seconds": 10},
    }


def batch(backend: LocalBackend, url: str, program: str, name: str, samples: int) -> dict:
    request = request_of(url, samples)
    rows: list[Any] = []
    figures = run(backend, request, name, program=program, rows_out=rows)
    grading = [r.cost["wall"]["tests"] for r in rows if r.cost and r.cost["wall"].get("tests")]
    figures["grading_seconds_per_episode"] = round(statistics.median(grading), 4)
    # The sandboxes' own share (runner, agent commands, tests: each row's ledger), to tell it
    # from the supervisor's and the kernel's in the cgroup's figure.
    inside = [r.cost["cpu_seconds"] for r in rows if r.cost and r.cost.get("cpu_seconds")]
    figures["sandbox_cpu_seconds_per_episode"] = round(statistics.mean(inside), 4)
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


def node_batch(client: Any, fields: dict, url: str, samples: int) -> dict:
    """One batch on the real node through the stack `client` submits to: figures from the
    report's rows (each Pod's cgroup CPU, grading seconds, rewards) and the batch's wall."""
    started = time.time()
    submitted = client.submit(
        **request_of(url, samples), **fields, backend="kubernetes", capacity_check="warn"
    )
    report = client.wait(submitted.batch_id, timeout=1800)
    wall = time.time() - started
    rows = report["pods"]
    bad = [r for r in rows if not r.get("cost") or r["cost"].get("cpu_seconds") is None]
    if bad or len(rows) != len(request_of(url, samples)["tasks"]) * samples:
        raise RuntimeError(f"rows without a cost ledger: {bad[:1]} ({len(rows)} rows)")
    cpu = [r["cost"]["cpu_seconds"] for r in rows]
    grading = [r["cost"]["wall"]["tests"] for r in rows if r["cost"]["wall"].get("tests")]
    return {
        "episodes": len(rows),
        "ok": sum(r.get("status") == "ok" for r in rows),
        "wall_seconds": round(wall, 1),
        "cpu_seconds_per_episode": round(statistics.mean(cpu), 4),
        "grading_seconds_per_episode": round(statistics.median(grading), 4),
        "rewards": {f"{r['task_id']}/{r['sample']}": r["reward"] for r in rows},
    }


def real_node_rounds(programs: dict[str, str], rounds: int, samples: int) -> dict[str, list]:
    from rollout_worker.cli.stack import LocalStack
    from tests.k8s import cluster as kc
    from trainer_stub.client import RolloutClient

    cluster = kc.ensure_cluster()
    node = kc.ensure_real_node(cluster)
    status: Any = cluster.core.read_node(node.name).status
    host = next(a.address for a in status.addresses if a.type == "InternalIP")
    results: dict[str, list] = {"before": [], "after": []}
    with contextlib.ExitStack() as stack, running(host="0.0.0.0") as server:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-grading-")))
        clients = {}
        for name, text in programs.items():
            (folder / f"{name}.py").write_text(text)
            env = {
                "KUBECONFIG": str(cluster.kubeconfig),
                "PYTHONPATH": os.pathsep.join((str(SWAP), os.environ.get("PYTHONPATH", ""))),
                "ROLLOUT_BENCH_PROGRAM": str(folder / f"{name}.py"),
            }
            workers = stack.enter_context(LocalStack(collectors=1, extra_env=env))
            workers.wait_ready()
            clients[name] = RolloutClient(workers.redis_url)
            stack.callback(clients[name].close)
        url = f"http://{host}:{server.port}"
        fields = node.batch_fields()
        for name in programs:  # unmeasured: the image and the node warm for both
            node_batch(clients[name], fields, url, 1)
        for number in range(rounds):
            order = ("before", "after") if number % 2 == 0 else ("after", "before")
            for name in order:
                figures = node_batch(clients[name], fields, url, samples)
                results[name].append(figures)
                shown = {k: v for k, v in figures.items() if k != "rewards"}
                sys.stdout.write(orjson.dumps({"round": number, "batch": name, **shown}).decode())
                sys.stdout.write("\n")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="6a3ec8d")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--real-node", action="store_true")
    args = parser.parse_args()
    if not args.real_node and (not (CPUACCT / "cpuacct.usage").exists() or os.geteuid() != 0):
        sys.exit("needs root and a cgroup v1 cpuacct hierarchy at /sys/fs/cgroup/cpuacct")
    programs = {"before": program_at(args.before), "after": episode_program_text()}
    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    if args.real_node:
        os.environ.setdefault("ROLLOUT_TESTS_DIR", tempfile.mkdtemp())
        summarize(real_node_rounds(programs, args.rounds, args.samples))
        return
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
    summarize(results)


def summarize(results: dict[str, list[dict]]) -> None:
    summary: dict[str, Any] = {}
    keys = ["cpu_seconds_per_episode", "grading_seconds_per_episode", "wall_seconds"]
    if all("sandbox_cpu_seconds_per_episode" in f for n in results for f in results[n]):
        keys.insert(1, "sandbox_cpu_seconds_per_episode")
    for key in keys:
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
