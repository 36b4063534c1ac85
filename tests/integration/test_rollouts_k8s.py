"""Real rollouts on the local cluster's real node: episode Pods run the agent runner in real
containers, read their tasks from the batch's ConfigMap and call the scripted policy, which
listens on the node's bridge address."""

from __future__ import annotations

import json
import re
import socket

import pytest

from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.policy_server import bundled_script, running
from tests.integration.agents import AGENT_ENVS, MINI_ENV, mini_command
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

PROBE = """
import json, socket
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
with open("/proc/net/if_inet6") as f:
    ipv6 = sorted({line.split()[-1] for line in f if line.split()[-1] != "lo"})
print(json.dumps({"policy": tcp(HOST, POLICY_PORT), "other": tcp(HOST, PORT), "ipv6": ipv6}))
"""


def tcp(host: str, port: int) -> str:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__


def node_address(k8s_cluster, name: str) -> str:
    node = k8s_cluster.core.read_node(name)
    return next(a.address for a in node.status.addresses if a.type == "InternalIP")


def submit(real_stack, real_node, policy_url, tasks, samples):
    client = RolloutClient(real_stack.redis_url)
    request = real_node.batch_fields() | {
        "backend": "kubernetes",
        "tasks": tasks,
        "samples_per_task": samples,
        "policy": {"url": policy_url, "request_timeout_seconds": 10, "max_retries": 1},
        "capacity_check": "warn",
    }
    return client, client.submit(**request)


def test_a_mixed_batch_on_the_real_node_gets_the_scripted_rewards(
    real_node, real_stack, k8s_cluster
):
    host = node_address(k8s_cluster, real_node.name)
    tasks = load_task_set("bundled", only=["fizzbuzz-order", "inventory-two-bugs", "palindrome"])
    with running(host="0.0.0.0", hangs=True, hang_seconds=25) as server:
        client, submission = submit(real_stack, real_node, f"http://{host}:{server.port}", tasks, 2)
        seen = dict(
            (row["index"], (row, trajectory))
            for row, trajectory in client.trajectories(submission.batch_id, timeout=600)
        )
        report = client.wait(submission.batch_id, timeout=60)
        calls = server.calls()
    assert sorted(seen) == list(range(6)), report["errors"]
    for index, (row, trajectory) in seen.items():
        episode = submission.spec.episode(index)
        assert (row["task_id"], row["sample"], row["group_id"]) == (
            episode.task_id,
            episode.sample,
            episode.group_id,
        )
        if episode.task_id == "palindrome":
            assert row["failure_kind"] == "infrastructure", row
            continue
        assert row["status"] == "ok", (row["errors"], calls)
        assert row["node"] == real_node.name
        want = 0 if (episode.task_id, episode.sample) == ("fizzbuzz-order", 1) else 1
        assert row["reward"] == want
        assert len(trajectory["steps"]) == (6 if episode.task_id == "inventory-two-bugs" else 2)
        assert trajectory["policy_base_url"] == (
            f"http://{host}:{server.port}/rollout/{row['pod']}/v1"
        )
    groups = {g["task_id"]: g for g in report["groups"]}
    assert groups["fizzbuzz-order"]["rewards"] == [1, 0]
    assert groups["inventory-two-bugs"]["mean"] == 1
    assert groups["palindrome"]["status"] == "failed"
    pods = {row["pod"]: row["group_id"] for row, _ in seen.values()}
    assert calls and all(pods[c["episode_id"]] == c["group_id"] for c in calls)


def test_the_cost_ledger_on_the_real_node_reads_each_pods_own_cgroup(
    real_node, real_stack, k8s_cluster
):
    """The same three episodes as the local ledger test (tests/integration/test_cost.py): the
    runner reads its container's cgroup and the numbers move with the work."""
    from tests.integration.test_cost import BURN_SECONDS, SCRIPT, task

    host = node_address(k8s_cluster, real_node.name)
    with running(host="0.0.0.0", script=SCRIPT) as server:
        tasks = [task("burn"), task("idle"), task("chatty")]
        client, submission = submit(real_stack, real_node, f"http://{host}:{server.port}", tasks, 1)
        report = client.wait(submission.batch_id, timeout=300)
    assert report["status"] == "succeeded", report["errors"]
    costs = {row["task_id"]: row["cost"] for row in report["pods"]}
    for name, cost in costs.items():
        assert cost["cpu_source"] == "cgroup", name  # the container's own, seen from inside
        assert cost["cpu_seconds"] > 0 and cost["peak_memory_bytes"] > 2**20, name
        assert cost["ledger_cpu_seconds"] <= 0.02 * cost["cpu_seconds"], (name, cost)
    assert costs["burn"]["cpu_seconds"] >= costs["idle"]["cpu_seconds"] + 0.8 * BURN_SECONDS
    assert costs["idle"]["cpu_seconds"] < 0.5 * costs["idle"]["wall"]["agent"]
    assert costs["chatty"]["policy_turns"] == 6 and costs["idle"]["policy_turns"] == 2
    assert costs["chatty"]["prompt_tokens"] > 3 * costs["idle"]["prompt_tokens"]
    assert report["cost"]["ledgers"] == 3


def test_a_pod_reaches_its_policy_endpoint_and_nothing_else(real_node, real_stack, k8s_cluster):
    """The batch's NetworkPolicy holds on the real node (hack/localkube/rollout-netpol): from
    an episode Pod, the policy endpoint answers and the node's kubelet port (same address,
    open to this machine) is filtered; the Pod has no IPv6 to go around the rules."""
    host = node_address(k8s_cluster, real_node.name)
    kubelet_port = k8s_cluster.core.read_node(
        real_node.name
    ).status.daemon_endpoints.kubelet_endpoint.port
    # The kubelet listens there: a failed probe from the Pod is the filter, not a closed port.
    assert tcp(host, kubelet_port) == "connected"
    task = {
        "id": "probe",
        "statement": "Probe the network.",
        "files": {"probe.py": ""},
        "test_files": {
            "test_never.py": "import unittest\n\n\nclass T(unittest.TestCase):\n"
            "    def test_fails(self):\n        self.fail()\n"
        },
        "test_command": ["python", "-B", "-m", "unittest"],
        "max_steps": 2,
    }
    with running(host="0.0.0.0") as server:
        # The policy endpoint, and another port of the same address (the node's kubelet),
        # reachable only if nothing filters.
        probe = (
            PROBE.replace("HOST", repr(host))
            .replace("POLICY_PORT", str(server.port))
            .replace("PORT", str(kubelet_port))
        )
        server._server.policy.tasks["probe"] = {
            "plans": [
                [
                    {"tool": "write_file", "arguments": {"path": "probe.py", "content": probe}},
                    {"tool": "run", "arguments": {"command": "python -B probe.py"}},
                ]
            ]
        }
        client, submission = submit(
            real_stack, real_node, f"http://{host}:{server.port}", [task], 1
        )
        rows = list(client.trajectories(submission.batch_id, timeout=300))
    ((row, trajectory),) = rows
    assert row["status"] == "ok", row["errors"]
    # The agent's policy calls went through (both steps came from the policy endpoint).
    assert [s["actions"][0]["tool"] for s in trajectory["steps"]] == ["write_file", "run"]
    observation = trajectory["steps"][1]["actions"][0]["observation"]
    found = re.search(r'\{"policy".*\}', observation)
    assert found, observation
    # Dropped, not refused: the connection attempt times out.
    assert json.loads(found.group(0)) == {
        "policy": "connected",
        "other": "TimeoutError",
        "ipv6": [],
    }, observation


def test_a_quota_on_the_real_node_stops_the_slow_rest_and_counts_none_of_it(
    real_node, real_stack, k8s_cluster
):
    """groups_wanted on Kubernetes: once the fast groups are in, the slow group's Pods are
    stopped (the Job suspended) and recorded `aborted`, never a failure or a reward."""
    host = node_address(k8s_cluster, real_node.name)
    script = bundled_script()
    script["tasks"]["clamp-range"] = {
        "plans": [[{"tool": "submit", "arguments": {}, "delay": 120}]]
    }
    fast = ["shipping-boundary", "fizzbuzz-order", "stack-pop"]
    tasks = load_task_set("bundled", only=[*fast, "clamp-range"])
    with running(host="0.0.0.0", script=script) as server:
        client = RolloutClient(real_stack.redis_url)
        request = real_node.batch_fields() | {
            "backend": "kubernetes",
            "tasks": tasks,
            "samples_per_task": 2,
            "policy": {"url": f"http://{host}:{server.port}", "request_timeout_seconds": 150},
            "capacity_check": "warn",
            "groups_wanted": len(fast),
        }
        submission = client.submit(**request)
        report = client.wait(submission.batch_id, timeout=300)
        pods = k8s_cluster.core.list_namespaced_pod(report["namespace"]).items
    assert report["status"] == "succeeded", report["errors"]
    assert {g.split(":")[1] for g in report["quota"]["counted"]} == set(fast)
    aborted = [r for r in report["pods"] if r["status"] == "aborted"]
    assert {r["task_id"] for r in aborted} == {"clamp-range"} and len(aborted) == 2
    assert report["failed_episodes"] == 0 and report["infrastructure_failures"] == 0
    assert all(r["reward"] == 0 and r["failure_kind"] is None for r in aborted)
    # When the report came, nothing of the batch was left running: every Pod had ended or
    # was being deleted by the suspended Job.
    still = [
        p.metadata.name
        for p in pods
        if p.metadata.deletion_timestamp is None and p.status.phase in ("Pending", "Running")
    ]
    assert still == [], still
    client.close()


# An agent that is only a command line (the image holds nothing of ours but Python): the
# OpenAI chat protocol by hand, a `bash` tool, until the policy submits or stops calling.
INLINE_AGENT = r"""
import json, os, subprocess, urllib.request
base, model = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_MODEL"]
tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
        "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
messages = [{"role": "user", "content": os.environ["ROLLOUT_STATEMENT"]}]
for _ in range(10):
    body = json.dumps({"model": model, "messages": messages, "tools": [tool]}).encode()
    request = urllib.request.Request(base + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
    message = json.load(urllib.request.urlopen(request))["choices"][0]["message"]
    messages.append(message)
    calls = message.get("tool_calls") or []
    if not calls:
        break
    command = json.loads(calls[0]["function"]["arguments"])["command"]
    if command.startswith("echo COMPLETE_TASK_AND_SUBMIT"):
        break
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                     "content": done.stdout + done.stderr})
"""


def test_their_agent_runs_in_the_pod_and_every_exchange_is_recorded(
    real_node, real_stack, k8s_cluster
):
    host = node_address(k8s_cluster, real_node.name)
    tasks = load_task_set("bundled", only=["shipping-boundary", "fizzbuzz-order"])
    with running(host="0.0.0.0") as server:
        client = RolloutClient(real_stack.redis_url)
        request = real_node.batch_fields() | {
            "backend": "kubernetes",
            "tasks": tasks,
            "samples_per_task": 2,
            "policy": {
                "url": f"http://{host}:{server.port}",
                "sampling": {"logprobs": True, "return_token_ids": True},
            },
            "capacity_check": "warn",
            "agent": {"command": ["python", "-c", INLINE_AGENT]},
        }
        submission = client.submit(**request)
        report = client.wait(submission.batch_id, timeout=300)
        calls = server.calls()
    assert report["status"] == "succeeded", report["errors"]
    rewards = {(r["task_id"], r["sample"]): r["reward"] for r in report["pods"]}
    assert rewards == {
        ("shipping-boundary", 0): 1,
        ("shipping-boundary", 1): 1,
        ("fizzbuzz-order", 0): 1,
        ("fizzbuzz-order", 1): 0,
    }
    for row in report["pods"]:
        assert row["node"] == real_node.name and row["agent_exit_code"] == 0
        steps = client.trajectory(submission.batch_id, row["index"])["steps"]
        assert len(steps) == len([c for c in calls if c["episode_id"] == row["pod"]]) >= 2
        assert all(s["response"]["choices"][0]["logprobs"]["content"] for s in steps)
    client.close()


def test_harbor_tasks_oracle_scores_one_on_the_real_node(real_node, real_stack):
    from pathlib import Path

    harbor = Path(__file__).resolve().parents[1] / "data" / "harbor"
    only = ["add-numbers", "partial-credit", "image-task"]
    # The image task's environment/Dockerfile, built and put on the node by the CLI.
    import subprocess
    import sys

    subprocess.run(["hack/docker-up.sh"], check=True, cwd=harbor.parents[2], timeout=600)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "tasks", "build", str(harbor)),
            *("--task", "image-task", "--node-import"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    client = RolloutClient(real_stack.redis_url)
    tasks = load_task_set(str(harbor), only)
    # A task in its own image grades in its agent's container: the batch's hidden tests reach
    # that runner alone. An agent that searches its whole Pod for add-numbers' tests (in the
    # batch's tasks file) finds nothing.
    from tests.red_team import LOOK_FOR_TESTS

    look = {"command": ["python", "-c", LOOK_FOR_TESTS]}
    tasks.append(next(t for t in tasks if t["id"] == "image-task") | {"id": "look", "agent": look})
    request = real_node.batch_fields() | {
        "backend": "kubernetes",
        "tasks": tasks,
        "capacity_check": "warn",
        "agent": "oracle",
        "policy": {"url": "http://127.0.0.1:9"},  # never asked
    }
    submission = client.submit(**request)
    report = client.wait(submission.batch_id, timeout=300)
    assert report["status"] == "succeeded", report["errors"]
    rewards = {r["task_id"]: r["reward"] for r in report["pods"]}
    assert rewards == dict.fromkeys(only, 1) | {"look": 0}
    found = next(r for r in report["pods"] if r["task_id"] == "look")["agent_output"]
    assert "hidden tests found: none" in found, found
    assert (
        next(r for r in report["pods"] if r["task_id"] == "partial-credit")["reward_details"][
            "checks_passed"
        ]
        == 4
    )
    client.close()


@pytest.fixture(scope="module")
def agent_image(real_node) -> str:
    """hack/agent-image.sh: the Python image plus mini-swe-agent and the openai client, in the
    node's containerd (built with Docker: hack/docker-up.sh)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for script in ("docker-up.sh", "agent-image.sh"):
        done = subprocess.run(
            [str(root / "hack" / script)], capture_output=True, text=True, timeout=1200
        )
        assert done.returncode == 0, f"hack/{script} failed: {done.stderr[-2000:]}"
    return done.stdout.strip().splitlines()[-1]


OPENAI_AGENT = [
    f"{AGENT_ENVS}/openai/bin/python",
    f"{AGENT_ENVS}/openai/openai_chat_agent.py",
]


@pytest.mark.parametrize(
    "agent",
    [
        {"command": mini_command(AGENT_ENVS / "mini"), "env": MINI_ENV},
        {"command": OPENAI_AGENT},
    ],
    ids=["mini-swe-agent", "openai-streaming"],
)
def test_third_party_agents_from_the_image_earn_the_scripted_rewards_on_the_real_node(
    real_node, real_stack, k8s_cluster, agent_image, agent
):
    host = node_address(k8s_cluster, real_node.name)
    tasks = load_task_set("bundled", only=["shipping-boundary", "inventory-two-bugs"])
    with running(host="0.0.0.0") as server:
        client = RolloutClient(real_stack.redis_url)
        request = real_node.batch_fields() | {
            "backend": "kubernetes",
            "image": agent_image,
            "tasks": tasks,
            "policy": {"url": f"http://{host}:{server.port}", "sampling": {"logprobs": True}},
            "capacity_check": "warn",
            "agent": agent,
            "resources": {"memory_limit": "512Mi"},  # litellm's imports need more than 128Mi
        }
        submission = client.submit(**request)
        report = client.wait(submission.batch_id, timeout=300)
        calls = server.calls()
    assert report["status"] == "succeeded", report["errors"]
    assert [r["reward"] for r in report["pods"]] == [1, 1], [r["errors"] for r in report["pods"]]
    for row in report["pods"]:
        steps = client.trajectory(submission.batch_id, row["index"])["steps"]
        assert len(steps) == len([c for c in calls if c["episode_id"] == row["pod"]]) >= 2
        assert all(s["response"]["choices"][0]["logprobs"]["content"] for s in steps)
        assert all(s["stream"] is (agent["command"] == OPENAI_AGENT) for s in steps)
    client.close()
