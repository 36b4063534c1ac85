"""What the recording proxy adds to each policy call (not a test): the same chat completions
sent to a policy server directly and through the path an agent command's calls take locally
(the runner's recording proxy, which asks for token ids, records the exchange as a step event
and keeps the token record, then the local backend's per-episode socket and host proxy), one
after the other in pairs. Printed: p50 and p99 of each and of the per-pair difference, and the
load average.

The server is the tiny engine (`--server engine`, the real model: answers take tens of ms) or
the scripted one (`--server scripted`, answers in well under a millisecond, so the proxy's own
cost is what is left). Both answer with token ids and log-probabilities.

With `--real-node`, the same pairs from inside a Pod on the local cluster's real node: an agent
command that calls the scripted server (on this host, through the Pod network and the batch's
NetworkPolicy) directly and through its runner's recording proxy, one after the other, and
prints its figures; one batch of one episode per run, through workers started here.

    python -m benchmarks.bench_proxy [--calls 500] [--server scripted|engine] [--runs 3]
    python -m benchmarks.bench_proxy --real-node [--calls 500] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import socket
import statistics
import tempfile
import time
import urllib.parse
from typing import Any

from rollout_wire.policy import PolicyEndpoint
from rollout_worker.backends.local.policy_proxy import EpisodeIdentity, PolicyProxy
from rollout_worker.cli.policy_server import running
from tests.runner_program import episode

EPISODE = "bench-proxy-0"
MESSAGES = [
    {"role": "system", "content": "You fix bugs. " * 40},
    {"role": "user", "content": "Fix shipping.py so the tests pass."},
]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def connect(host: str, port: int) -> http.client.HTTPConnection:
    """A keep-alive connection without Nagle's delay (http.client writes the headers and the
    body apart: with Nagle, a second small write waits for the first one's ACK, ~40 ms)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def call(conn: http.client.HTTPConnection, path: str, body: bytes) -> float:
    started = time.perf_counter()
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    data = answer.read()
    elapsed = time.perf_counter() - started
    if answer.status != 200:
        raise RuntimeError(f"HTTP {answer.status}: {data[:200]!r}")
    return elapsed


def one_run(url: str, calls: int) -> dict[str, Any]:
    policy = PolicyEndpoint(url=url, request_timeout_seconds=30)
    identity = EpisodeIdentity(EPISODE, "b:t", "t", 0, 0)
    host = PolicyProxy(policy, 35.0)
    sock = host.open(0, identity)
    os.environ["EPISODE_ID"] = EPISODE
    os.environ["ROLLOUT_POLICY_SOCKET"] = str(sock)
    fields = {"group_id": "b:t", "task_id": "t", "sample": 0, "attempt": 0}
    runner_policy = episode.Policy(json.loads(policy.runner_json()), EPISODE, fields)
    proxy = episode.Proxy(runner_policy, fields)
    proxy.start()
    parts = urllib.parse.urlsplit(url)
    direct = connect(parts.hostname or "", parts.port or 80)
    through = connect("127.0.0.1", proxy.server.server_address[1])
    # What the runner sends upstream, sent directly too: same work on the server's side.
    upstream = {"model": policy.model, "messages": MESSAGES, "max_tokens": 8}
    upstream |= episode.TOKEN_REQUEST
    direct_body = json.dumps(upstream).encode()
    agent_body = json.dumps({"model": "any", "messages": MESSAGES, "max_tokens": 8}).encode()
    direct_path = f"/rollout/{EPISODE}/v1/chat/completions"
    plain: list[float] = []
    proxied: list[float] = []
    recorded = io.StringIO()
    try:
        with contextlib.redirect_stdout(recorded):  # the step events the proxy writes
            for _ in range(20):  # warm both paths (connections, caches)
                call(direct, direct_path, direct_body)
                call(through, "/v1/chat/completions", agent_body)
            for _ in range(calls):
                plain.append(call(direct, direct_path, direct_body))
                proxied.append(call(through, "/v1/chat/completions", agent_body))
    finally:
        direct.close()
        through.close()
        proxy.close()
        host.close_all()
    steps = [json.loads(line) for line in recorded.getvalue().splitlines()]
    assert all("completion_ids" in s["tokens"] for s in steps), "a step has no token record"
    return figures(plain, proxied)


# The agent command of a --real-node run (stdlib only; <DIRECT>, <BODY>, <CALLS> filled in).
POD_PAIRS = """
import http.client, json, os, socket, time, urllib.parse

def connect(netloc):
    conn = http.client.HTTPConnection(netloc, timeout=30)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn

def call(conn, path, body):
    started = time.perf_counter()
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    answer.read()
    assert answer.status == 200, answer.status
    return time.perf_counter() - started

direct = connect("<DIRECT>")
proxy_url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
through = connect(proxy_url.netloc)
direct_path = "/rollout/%s/v1/chat/completions" % socket.gethostname()
proxy_path = proxy_url.path.rstrip("/") + "/chat/completions"
body = json.loads(<BODY>)
direct_body = json.dumps(body).encode()
agent_body = json.dumps(dict(body, model="any")).encode()
plain, proxied = [], []
for number in range(20 + <CALLS>):
    a = call(direct, direct_path, direct_body)
    b = call(through, proxy_path, agent_body)
    if number >= 20:
        plain.append(a)
        proxied.append(b)
def at(values, share):  # as percentile() in bench_proxy
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

extra = [b - a for a, b in zip(plain, proxied)]
found = {"calls": len(plain)}
for name, values in (("direct", plain), ("proxied", proxied), ("overhead", extra)):
    for share in (50, 99):
        found["%s_p%d_ms" % (name, share)] = round(at(values, share / 100) * 1000, 3)
print("PAIRS " + json.dumps(found))  # the output's tail is kept: 4 KiB, so figures only
"""


def figures(plain: list[float], proxied: list[float]) -> dict[str, Any]:
    extra = [(b - a) * 1000 for a, b in zip(plain, proxied, strict=True)]
    return {
        "calls": len(plain),
        "direct_p50_ms": round(percentile(plain, 0.5) * 1000, 3),
        "direct_p99_ms": round(percentile(plain, 0.99) * 1000, 3),
        "proxied_p50_ms": round(percentile(proxied, 0.5) * 1000, 3),
        "proxied_p99_ms": round(percentile(proxied, 0.99) * 1000, 3),
        "overhead_p50_ms": round(percentile(extra, 0.5), 3),
        "overhead_p99_ms": round(percentile(extra, 0.99), 3),
    }


def real_node_runs(calls: int, runs: int, cpu_limit: str) -> list[dict[str, Any]]:
    """One batch per run on the real node; each Pod's agent times the pairs itself."""
    from rollout_worker.cli.stack import LocalStack
    from tests.k8s import cluster as kc
    from trainer_stub.client import RolloutClient

    cluster = kc.ensure_cluster()
    node = kc.ensure_real_node(cluster)
    address = cluster.core.read_node(node.name).status.addresses
    host = next(a.address for a in address if a.type == "InternalIP")
    results = []
    with (
        running(host="0.0.0.0") as server,
        LocalStack(collectors=1, extra_env={"KUBECONFIG": str(cluster.kubeconfig)}) as stack,
    ):
        stack.wait_ready()
        url = f"http://{host}:{server.port}"
        policy = PolicyEndpoint(url=url, request_timeout_seconds=30)
        body = {"model": policy.model, "messages": MESSAGES, "max_tokens": 8}
        body |= episode.TOKEN_REQUEST
        source = (
            POD_PAIRS.replace("<DIRECT>", f"{host}:{server.port}")
            .replace("<BODY>", repr(json.dumps(body)))
            .replace("<CALLS>", str(calls))
        )
        task = {
            "id": "pairs",
            "statement": "time the policy calls",
            "files": {"README": "x\n"},
            "test_files": {"test_ok.py": "import sys\nsys.exit(1)\n"},
            "test_command": ["python", "test_ok.py"],
            "baseline": False,
            "agent": {"command": ["python", "-c", source]},
            "time_limit_seconds": 600,
        }
        client = RolloutClient(stack.redis_url)
        try:
            for run in range(runs):
                batch = client.submit(
                    **node.batch_fields(),
                    backend="kubernetes",
                    tasks=[task],
                    policy={"url": url, "request_timeout_seconds": 30},
                    capacity_check="warn",
                    resources={"cpu_limit": cpu_limit},
                    episode_timeout_seconds=900,
                    deadline_seconds=1200,
                )
                report = client.wait(batch.batch_id, timeout=1200)
                (row,) = report["pods"]
                line = next(
                    (
                        x
                        for x in (row.get("agent_output") or "").splitlines()
                        if x.startswith("PAIRS ")
                    ),
                    None,
                )
                if line is None:
                    raise RuntimeError(
                        f"run {run}: no figures: {row.get('errors')} {row.get('agent_output')}"
                    )
                result = json.loads(line[len("PAIRS ") :])
                print(f"run {run}: {result}", flush=True)
                results.append(result)
        finally:
            client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server", choices=["scripted", "engine"], default="scripted")
    parser.add_argument("--real-node", action="store_true")
    # The sandbox's CPU limit on the real node (the batch default, 500m, throttles the
    # runner's proxy in 100 ms periods: the tail of a busy second).
    parser.add_argument("--cpu-limit", default="500m")
    args = parser.parse_args()
    os.environ.setdefault("ROLLOUT_TESTS_DIR", tempfile.mkdtemp())
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = real_node_runs(args.calls, args.runs, args.cpu_limit) if args.real_node else []
    for run in range(0 if args.real_node else args.runs):
        if args.server == "engine":
            from trainer_stub.engine import EngineServer, build_model

            server = EngineServer(build_model(seed=run)).start()
            try:
                result = one_run(server.url, args.calls)
            finally:
                server.close()
        else:
            with running() as scripted:
                result = one_run(scripted.url, args.calls)
        print(f"run {run}: {result}", flush=True)
        results.append(result)
    for key in ("overhead_p50_ms", "overhead_p99_ms", "direct_p50_ms", "proxied_p50_ms"):
        print(f"median {key}: {statistics.median(r[key] for r in results)}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
