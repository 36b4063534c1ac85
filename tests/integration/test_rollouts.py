"""Real rollouts on the local backend: bundled tasks, the scripted policy in the loop, through
real bwrap sandboxes that reach the policy only through their socket.

The scripted policy (rollout_worker/data/bundled-policy.json) decides what each sample does;
the expectations below say what those actions must produce when they really run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from rollout_wire.request import parse_spec
from rollout_wire.tasksets import bundled_tasks
from rollout_wire.trajectory import trajectory_from_log
from rollout_worker.backends.local.backend import LocalBackend
from rollout_worker.cli.policy_server import running
from rollout_worker.report import build_report
from rollout_worker.settings import Settings
from rollout_worker.validation import validate_episode
from tests.runner_program import episode

MAX_OBSERVATION_BYTES = episode.MAX_OBSERVATION_BYTES
TRUNCATION_MARKER = episode.TRUNCATION_MARKER

pytestmark = pytest.mark.slow

# task id -> per sample (0, 1): reward, or "infrastructure"; and the steps each sample takes.
EXPECTED = {
    "shipping-boundary": ([1, 1], 2),
    "fizzbuzz-order": ([1, 0], 2),  # odd samples write a wrong fix
    "leap-year": ([0.75, 0.75], 2),  # fraction: the fix breaks centuries
    "word-count": ([0.8, 0.8], 2),  # fraction: newlines still wrong
    "temperature": ([1, 1], 3),  # a malformed reply first
    "stack-pop": ([1, 1], 2),  # slow replies
    "inventory-two-bugs": ([1, 1], 6),  # multi-step
    "palindrome": (["infrastructure", "infrastructure"], 0),  # the policy times out
    "clamp-range": ([0, 0], 3),  # never submits: the step limit
}
POLICY = {
    "model": "scripted",
    "sampling": {"temperature": 1.0, "logprobs": True, "return_token_ids": True},
    "request_timeout_seconds": 2,
    "max_retries": 1,
}


@pytest.fixture
def backend(open_tmp_path):
    # No Redis here: the supervisor's progress reports are best effort.
    return LocalBackend(
        Settings(local_root=open_tmp_path / "runs", redis_url="redis://127.0.0.1:9/0")
    )


def run_batch(backend, spec, timeout=120):
    handle = backend.start_run(spec, lambda fields: None)
    rows, logs = [], {}
    for index in range(spec.count):
        obs = backend.wait_episode(handle, index, timeout)
        assert obs.terminal, obs
        logs[index] = backend.read_output(handle, obs)
        rows.append(validate_episode(obs, logs[index], handle.origin))
    finished = backend.finish_run(spec, handle)
    report = build_report(
        spec, rows, handle, finished, finalized_by="test", reported_at=time.time()
    )
    backend.delete_run(handle)
    return rows, logs, report


def test_a_mixed_bundled_batch_gets_exactly_the_rewards_the_scripted_actions_produce(backend):
    tasks = bundled_tasks()
    assert {t["id"] for t in tasks} == set(EXPECTED)
    with running(hangs=True, hang_seconds=5) as server:
        spec = parse_spec(
            {
                "tasks": tasks,
                "samples_per_task": 2,
                "parallelism": 6,
                "policy": POLICY | {"url": server.url},
            },
            max_episodes=100,
        )
        rows, logs, report = run_batch(backend, spec)
        calls = server.calls()

    for row in rows:
        episode = spec.episode(row.index)
        want, steps = EXPECTED[episode.task_id]
        want = want[episode.sample]
        assert (row.task_id, row.sample, row.group_id) == (
            episode.task_id,
            episode.sample,
            episode.group_id,
        )
        if want == "infrastructure":
            assert row.status == "failed" and row.failure_kind == "infrastructure", row
            assert "timed out" in row.failure_cause and row.reward == 0
            continue
        assert row.status == "ok", (episode.task_id, row.errors)
        assert row.reward == pytest.approx(want), episode.task_id
        assert row.steps == steps, episode.task_id
        trajectory = trajectory_from_log(logs[row.index])
        assert [s["step"] for s in trajectory["steps"]] == list(range(1, steps + 1))
        for s in trajectory["steps"]:
            # Verbatim: the server's response, log-probabilities included; its ids moved to
            # the step's token record, stored once.
            choice = s["response"]["choices"][0]
            assert s["response"]["object"] == "chat.completion"
            assert choice["logprobs"]["content"] and s["tokens"]["completion_ids"]
            assert s["policy_seconds"] >= 0 and s["action_seconds"] >= 0
        # The loop carries each answer back as it came: one sequence, every answer masked in.
        view = trajectory["tokens"]
        assert (view["tokens"], view["layout"], len(view["turns"])) == (
            "available",
            "sequence",
            steps,
        )
        assert sum(view["response_mask"]) == sum(
            len(s["tokens"]["completion_ids"]) for s in trajectory["steps"]
        )
        tools = [a["tool"] for s in trajectory["steps"] for a in s["actions"]]
        if episode.task_id == "inventory-two-bugs":
            assert tools == ["run", "write_file", "run", "write_file", "run", "submit"]
            observations = [s["actions"][0]["observation"] for s in trajectory["steps"]]
            assert "FAILED (failures=2)" in observations[0]
            assert "FAILED (failures=1)" in observations[2]
            assert observations[4].strip().endswith("OK")
        if episode.task_id == "temperature":
            assert trajectory["steps"][0]["error"].startswith("malformed reply")
            assert trajectory["steps"][0]["actions"] == []
        if episode.task_id == "stack-pop":
            assert all(s["policy_seconds"] >= 1.0 for s in trajectory["steps"])
        if episode.task_id == "clamp-range":
            assert row.stop_reason == "max_steps"

    groups = {g["task_id"]: g for g in report["groups"]}
    assert len(groups) == 9
    fizz = groups["fizzbuzz-order"]
    assert fizz["rewards"] == [1, 0] and fizz["mean"] == 0.5 and fizz["std"] == 0.5
    assert fizz["pass_at_k"] == {"1": 0.5, "2": 1.0}
    assert groups["leap-year"]["mean"] == pytest.approx(0.75)
    assert groups["leap-year"]["pass_at_k"] == {"1": 0.0, "2": 0.0}
    assert groups["palindrome"]["status"] == "failed"
    assert groups["palindrome"]["rewards"] == [] and groups["palindrome"]["mean"] is None
    assert {f["failure_kind"] for f in groups["palindrome"]["failed"]} == {"infrastructure"}
    assert all(g["status"] == "complete" for t, g in groups.items() if t != "palindrome")
    assert report["infrastructure_failures"] == 2 and report["episode_failures"] == 0
    assert report["reward_sum"] == pytest.approx(1 * 2 + 1 + 1.5 + 1.6 + 2 + 2 + 2)

    # Every call named its episode in the path and carried the episode's group id; the samples
    # of one task were shown the same prompt.
    by_episode = {row.pod: spec.episode(row.index) for row in rows}
    assert calls and all(c["episode_id"] in by_episode for c in calls)
    for call in calls:
        episode = by_episode[call["episode_id"]]
        assert call["group_id"] == episode.group_id
        assert (call["task_id"], call["sample"]) == (episode.task_id, episode.sample)
        assert call["path"] == f"/rollout/{call['episode_id']}/v1/chat/completions"


PROBE = """
import json, socket, http.client
facts = {}
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
facts["policy_tcp"] = tcp("127.0.0.1", PORT)
facts["outside_tcp"] = tcp("1.1.1.1", 53)
def via_socket(method, path):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/sandbox/policy.sock")
    c = http.client.HTTPConnection("policy")
    c.sock = s
    c.request(method, path, body=b"{}" if method == "POST" else None)
    return c.getresponse().status
facts["other_episode"] = via_socket("POST", "/rollout/someone-else/v1/chat/completions")
facts["other_path"] = via_socket("GET", "/calls")
facts["own_models"] = via_socket("GET", "/rollout/EPISODE/v1/models")
print(json.dumps(facts))
"""


def test_a_sandbox_reaches_its_policy_endpoint_and_nothing_else(backend, tmp_path):
    task = {
        "id": "probe",
        "statement": "Probe the network.",
        "files": {"probe.py": "placeholder\n"},
        "test_files": {
            "test_never.py": "import unittest\n\n\nclass T(unittest.TestCase):\n"
            "    def test_fails(self):\n        self.fail()\n"
        },
        "test_command": ["python", "-B", "-m", "unittest"],
        "max_steps": 3,
    }
    with running(hang_seconds=5) as server:
        spec = parse_spec(
            {"tasks": [task], "policy": POLICY | {"url": server.url}}, max_episodes=10
        )
        probe = PROBE.replace("PORT", str(server.port)).replace(
            "EPISODE", f"rollout-{spec.batch_id}-0"
        )
        server._server.policy.tasks["probe"] = {
            "plans": [
                [
                    {"tool": "write_file", "arguments": {"path": "probe.py", "content": probe}},
                    {"tool": "run", "arguments": {"command": "python -B probe.py"}},
                    {"tool": "run", "arguments": {"command": "python -c \"print('x' * 10000)\""}},
                ]
            ]
        }
        rows, logs, _ = run_batch(backend, spec)
        calls = server.calls()
    assert rows[0].status == "ok", rows[0].errors
    assert rows[0].reward == 0 and rows[0].stop_reason == "max_steps"
    steps = trajectory_from_log(logs[0])["steps"]
    observation = steps[1]["actions"][0]["observation"]
    assert observation.startswith("exit code 0"), observation
    facts = json.loads(observation.split("\n", 1)[1])
    assert facts["policy_tcp"] != "connected"  # no network: not even the policy's own port
    assert facts["outside_tcp"] != "connected"
    assert facts["other_episode"] == 403  # the socket forwards only this episode's calls
    assert facts["other_path"] == 403
    assert facts["own_models"] == 200
    # Observations are cut to 4 KiB with the documented marker.
    long = steps[2]["actions"][0]
    assert long["truncated"] is True and long["observation_bytes"] > 10000
    marker = TRUNCATION_MARKER.format(omitted=long["observation_bytes"] - MAX_OBSERVATION_BYTES)
    assert long["observation"].endswith(marker)
    # The server saw the three turns and the models call, and never a call for another episode.
    assert {c["episode_id"] for c in calls} == {f"rollout-{spec.batch_id}-0"}


def test_without_bwrap_the_runner_still_gets_its_task_and_socket():
    """Isolation "none" (no bubblewrap): host paths instead of mounts, same outcome. The
    episode runs as uid 1000, so its run folder must be reachable (pytest's tmp_path is not)."""
    root = tempfile.TemporaryDirectory(prefix="rollout-none-")
    os.chmod(root.name, 0o755)
    backend = LocalBackend(
        Settings(
            local_root=Path(root.name) / "runs",
            redis_url="redis://127.0.0.1:9/0",
            local_isolation="none",
        )
    )
    tasks = [t for t in bundled_tasks() if t["id"] in ("fizzbuzz-order", "leap-year")]
    with running() as server:
        spec = parse_spec(
            {"tasks": tasks, "samples_per_task": 2, "policy": POLICY | {"url": server.url}},
            max_episodes=10,
        )
        rows, _, report = run_batch(backend, spec)
    assert [r.reward for r in rows] == [1, 0, 0.75, 0.75], [r.errors for r in rows]
    assert report["run_isolation"] == "none"
    root.cleanup()


def test_the_guides_demo_is_a_built_in_task_a_policy_can_play(backend):
    with running() as server:
        spec = parse_spec({"count": 2, "policy": POLICY | {"url": server.url}}, max_episodes=10)
        rows, logs, report = run_batch(backend, spec)
    assert [(r.status, r.reward, r.task_id, r.sample) for r in rows] == [
        ("ok", 1, "shipping-demo", 0),
        ("ok", 1, "shipping-demo", 1),
    ]
    assert "shipping.py" in trajectory_from_log(logs[0])["steps"][0]["actions"][0]["observation"]
    assert [g["task_id"] for g in report["groups"]] == ["shipping-demo"]


def test_a_policy_cannot_pass_by_shadowing_the_test_runner(backend):
    """An agent that writes its own `unittest.py` (which would win over the standard library)
    gets it removed before the final tests: the reward comes from the real tests."""
    fake = "import sys\nprint('Ran 3 tests in 0.0s\\n\\nOK')\nsys.exit(0)\n"
    with running() as server:
        server._server.policy.tasks["shipping-boundary"] = {
            "plans": [
                [{"tool": "write_file", "arguments": {"path": "unittest.py", "content": fake}}]
            ]
        }
        tasks = [t for t in bundled_tasks() if t["id"] == "shipping-boundary"]
        spec = parse_spec({"tasks": tasks, "policy": POLICY | {"url": server.url}}, max_episodes=5)
        rows, logs, _ = run_batch(backend, spec)
    assert rows[0].status == "ok" and rows[0].reward == 0, rows[0].errors
    assert trajectory_from_log(logs[0])["outcome"]["removed_before_tests"] == ["unittest.py"]
