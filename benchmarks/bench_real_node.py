"""Side by side on the real node: the guide's own script and `rollout run --backend kubernetes`,
10 episodes each, alternating, several rounds.

- The guide's script is rebuilt at run time from the guide's text (benchmarks/guide_script.py;
  it is never stored in this repository) and run as the guide says (`run --output DIR --count
  N --image IMAGE --runtime CLASS`) with the pinned kubectl first on PATH. The only change: its
  Pod template also gets the real node's nodeSelector and toleration (the node is tainted so
  that only Pods meant for it land there); a placement, nothing the kubelet does differently.
- Ours: `rollout run` with the real node's flags and `--output DIR`, submitting to workers
  already running (a control worker and two collectors, started once, warm): the way a
  trainer's client meets a deployment.
- Client wall time: the command's process from start to exit (both write their records
  before they exit). Pod-to-ready p50: each run's own results.json (the guide's metric:
  Pod creationTimestamp -> the episode's `ready` event).
- Last Pod terminal: when the benchmark's own watch (all namespaces, the Jobs' Pods) first saw
  the run's last Pod Succeeded or Failed. From it: to the client's exit (both), and to the
  report's `reported_at` (ours; the goal is 0.3 s). Negative: the report came first (our
  collectors take an episode as ended when its container exits, about a second before the
  kubelet moves the Pod's phase).
- One round = one run of each (which goes first alternates); one unmeasured warm-up of each
  first. Each run's namespace is deleted (not timed) before the next.

Needs the local cluster with the real node: `hack/localkube/cluster.sh node-up`.

    python -m benchmarks.bench_real_node [--rounds 3] [--count 10] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import watch

from benchmarks.guide_script import guide_script
from benchmarks.harness import cell, new_parser
from rollout_worker.cli.stack import LocalStack
from tests.k8s import cluster as kc

ROOT = Path(__file__).resolve().parents[1]
ENDS: PodEnds | None = None  # the benchmark's watch of the Jobs' Pods (started in main)
# The guide's figures (seed, 10 parallel, two 64-vCPU nodes): SPEC-DIGEST.md.
GUIDE_SEED = {"Pod created -> ready p50 s": 3.7, "client sees Job complete s": 12.7}
# Where the placement goes into the guide's Pod template (checked to occur exactly once).
TEMPLATE_ANCHOR = "restartPolicy='Never',"


def placed_guide_script(node: kc.RealNode) -> str:
    source = guide_script()
    if source.count(TEMPLATE_ANCHOR) != 1:
        raise RuntimeError(f"the guide's Pod template changed: {TEMPLATE_ANCHOR!r} not found once")
    placement = (
        f"{TEMPLATE_ANCHOR} nodeSelector={node.node_selector!r}, tolerations={node.tolerations!r},"
    )
    return source.replace(TEMPLATE_ANCHOR, placement)


class PodEnds(threading.Thread):
    """When each Job Pod (label job-name=rollout, any namespace) was first seen terminal."""

    def __init__(self, cluster: kc.Cluster) -> None:
        super().__init__(daemon=True)
        self.core = cluster.core
        self.ended: dict[tuple[str, str], float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        version = None
        while not self.halt.is_set():
            stream = watch.Watch()
            kwargs: dict[str, Any] = {
                "label_selector": "batch.kubernetes.io/job-name=rollout",
                "timeout_seconds": 30,
                "deserialize": False,
            }
            if version:
                kwargs["resource_version"] = version
            try:
                for event in stream.stream(self.core.list_pod_for_all_namespaces, **kwargs):
                    now = time.time()
                    pod = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        version = None
                        break
                    meta = pod.get("metadata") or {}
                    version = meta.get("resourceVersion", version)
                    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                        self.ended.setdefault((meta["namespace"], meta["name"]), now)
                    if self.halt.is_set():
                        break
            except Exception:
                version = None
                time.sleep(0.2)
            finally:
                stream.stop()

    def last(self, namespace: str | None) -> float | None:
        times = [t for (ns, _), t in list(self.ended.items()) if ns == namespace]
        return max(times) if times else None


def kubectl_dir() -> Path:
    bin_dir = Path(os.environ.get("ROLLOUT_LOCALKUBE_CACHE", "/var/cache/rollout-localkube"))
    versions = (ROOT / "hack/localkube/versions.env").read_text()
    version = next(
        line.split(":-", 1)[1].rstrip('}"')
        for line in versions.splitlines()
        if line.startswith("K8S_VERSION=")
    )
    found = bin_dir / version / "bin"
    if not (found / "kubectl").exists():
        raise RuntimeError(f"no kubectl in {found}: run hack/localkube/cluster.sh up")
    return found


def metric(results: dict[str, Any], key: str) -> float | None:
    for place in (results, results.get("metrics") or {}, results.get("summary") or {}):
        if isinstance(place, dict) and isinstance(place.get(key), int | float):
            return float(place[key])
    return None


def run_guide(script: Path, node: kc.RealNode, count: int, out: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, str(script), "run", "--output", str(out), "--count", str(count)]
    cmd += ["--image", node.image, "--runtime", node.runtime_class]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall, exited = time.monotonic() - t0, time.time()
    results = json.loads((out / "results.json").read_text()) if done.returncode == 0 else {}
    last = ENDS.last(results.get("namespace")) if ENDS else None
    cleanup = subprocess.run(
        [sys.executable, str(script), "cleanup", "--output", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {
        "who": "guide",
        "ok": done.returncode == 0 and results.get("reward_sum") == count,
        "wall": wall,
        "p50": metric(results, "pod_to_ready_p50_seconds"),
        "all_ready": metric(results, "batch_to_all_ready_seconds"),
        "all_rewards": metric(results, "batch_to_all_rewards_seconds"),
        "job_complete_seen": metric(results, "client_job_complete_seconds"),
        "terminal_to_exit": exited - last if last else None,
        "error": "" if done.returncode == 0 else done.stderr[-800:],
        "cleanup_rc": cleanup.returncode,
    }


def run_ours(node: kc.RealNode, count: int, out: Path, env: dict[str, str]) -> dict:
    cmd = [str(Path(sys.executable).parent / "rollout"), "run", *node.run_flags()]
    cmd += ["--count", str(count), "--output", str(out)]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall, exited = time.monotonic() - t0, time.time()
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    last = ENDS.last(results.get("namespace")) if ENDS else None
    reported = metric(results, "reported_at")
    cleanup = subprocess.run(
        [str(Path(sys.executable).parent / "rollout"), "cleanup", "--output", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {
        "who": "ours",
        "ok": done.returncode == 0 and metric(results, "reward_sum") == count,
        "wall": wall,
        "p50": metric(results, "pod_to_ready_p50_seconds"),
        "all_ready": metric(results, "batch_to_all_ready_seconds"),
        "all_rewards": metric(results, "batch_to_all_rewards_seconds"),
        "submit_to_report": metric(results, "client_submit_to_report_seconds"),
        "terminal_to_exit": exited - last if last else None,
        "terminal_to_report": reported - last if last and reported else None,
        "error": "" if done.returncode == 0 else (done.stdout + done.stderr)[-800:],
        "cleanup_rc": cleanup.returncode,
    }


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON lines of every run (default: tmp)")
    args = parser.parse_args()
    global ENDS
    cluster = kc.ensure_cluster()
    node = kc.ensure_real_node(cluster)
    ENDS = PodEnds(cluster)
    ENDS.start()
    work = Path(tempfile.mkdtemp(prefix="bench-real-node-"))
    script = work / "rl-batch-demo.py"
    script.write_text(placed_guide_script(node))
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "PATH": f"{kubectl_dir()}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("ROLLOUT_KUBE_CONTEXT", None)
    log_path = Path(args.out or work / "runs.jsonl")
    runs: list[dict] = []
    with (
        LocalStack(collectors=2, extra_env={"KUBECONFIG": str(cluster.kubeconfig)}) as stack,
        log_path.open("a") as log,
    ):
        stack.wait_ready()
        ours_env = {**env, "ROLLOUT_REDIS_URL": stack.redis_url}
        print(f"real node {node.name}; runs logged to {log_path}", flush=True)
        n = 0

        def one(who: str, measured: bool) -> None:
            nonlocal n
            n += 1
            out = work / f"{n:02d}-{who}"
            if who == "guide":
                row = run_guide(script, node, args.count, out, env)
            else:
                row = run_ours(node, args.count, out, ours_env)
            row["measured"] = measured
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(
                f"  {'' if measured else '(warm-up) '}{who}: ok={row['ok']} wall "
                f"{row['wall']:.2f}s pod->ready p50 {row['p50']} all ready {row['all_ready']}"
                + (f" ERROR {row['error']}" if row["error"] else ""),
                flush=True,
            )
            if measured:
                runs.append(row)

        one("guide", False)
        one("ours", False)
        for r in range(args.rounds):
            order = ("guide", "ours") if r % 2 == 0 else ("ours", "guide")
            for who in order:
                one(who, True)
    print_table(args, runs, node)


def print_table(args: argparse.Namespace, runs: list[dict], node: kc.RealNode) -> None:
    guide = [r for r in runs if r["who"] == "guide"]
    ours = [r for r in runs if r["who"] == "ours"]
    print()
    print(
        f"real node, {os.cpu_count()} cpus, {args.count} episodes in parallel, image "
        f"{node.image}, runtime {node.runtime_class}; {args.rounds} rounds (alternating); "
        "median [min-max]"
    )
    width = 26
    print(f"{'figure':<44}{'guide script':>{width}}{'rollout run':>{width}}   goal")

    def row(label: str, key: str, goal: str = "") -> None:
        print(
            f"{label:<44}{cell([r.get(key) for r in guide]):>{width}}"
            f"{cell([r.get(key) for r in ours]):>{width}}   {goal}"
        )

    print(
        f"{'ok (reward_sum = N)':<44}{sum(r['ok'] for r in guide):>{width - 2}}/{len(guide)}"
        f"{sum(r['ok'] for r in ours):>{width - 2}}/{len(ours)}"
    )
    row("client wall time s", "wall", "ours <= 0.7 x guide's")
    row("Pod created -> ready p50 s", "p50", "ours <= guide's")
    row("Job created -> all ready s", "all_ready")
    row("Job created -> all rewards s", "all_rewards")
    row("guide: client sees Job complete s", "job_complete_seen")
    row("ours: submit -> report (client) s", "submit_to_report")
    row("last Pod terminal -> client exits s", "terminal_to_exit")
    row("last Pod terminal -> report published s", "terminal_to_report", "<= 0.3 s (ours)")
    walls_g = [r["wall"] for r in guide if r["ok"]]
    walls_o = [r["wall"] for r in ours if r["ok"]]
    p50_g = [r["p50"] for r in guide if r["ok"] and r["p50"] is not None]
    p50_o = [r["p50"] for r in ours if r["ok"] and r["p50"] is not None]
    if walls_g and walls_o:
        ratio = statistics.median(walls_o) / statistics.median(walls_g)
        print(f"wall time ours / guide's (medians): {ratio:.2f} (goal <= 0.70)")
    if p50_g and p50_o:
        diff = statistics.median(p50_o) - statistics.median(p50_g)
        print(f"Pod-to-ready p50 ours - guide's (medians): {diff:+.2f} s (goal <= 0)")
    print(
        "guide's own figures (seed, two 64-vCPU nodes): "
        + ", ".join(f"{k} {v}" for k, v in GUIDE_SEED.items())
    )


if __name__ == "__main__":
    main()
