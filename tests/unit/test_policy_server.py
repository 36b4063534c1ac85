"""The scripted policy server (hangs opt-in, the latency tail, the policy version) and the
runner's side of versions: what it records per turn and when it stops an episode as stale."""

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.parse

import pytest
from click.testing import CliRunner

from rollout_worker.cli import main as cli_main
from rollout_worker.cli import policy_server as ps
from rollout_worker.cli.policy_server import ScriptedPolicy, bundled_script, running
from rollout_worker.observation import EpisodeObservation
from rollout_worker.sandbox import episode_program_text
from rollout_worker.validation import validate_episode
from tests.runner_program import episode

SUBMIT = {"tool": "submit", "arguments": {}}
TASK = {
    "id": "steps",
    "statement": "Take a few steps.",
    "files": {"notes.py": "x = 1\n"},
    "test_command": ["python", "-B", "-c", "raise SystemExit(1)"],
    "max_steps": 6,
}
STEPS_SCRIPT = {
    "tasks": {
        "steps": {
            "plans": [
                [
                    {"tool": "run", "arguments": {"command": "true"}},
                    {"tool": "run", "arguments": {"command": "true"}},
                    {"tool": "run", "arguments": {"command": "true"}},
                    SUBMIT,
                ]
            ]
        }
    }
}


def post(url, path, body, headers=None, timeout=10.0):
    """(status, headers, parsed body) of one POST."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(
            "POST", path, body=data, headers={"Content-Type": "application/json"} | (headers or {})
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read() or b"null")
    finally:
        conn.close()


def ask(url, task, sample=0, group=None, turns=0, timeout=10.0):
    messages = [{"role": "user", "content": "go"}] + [{"role": "assistant", "content": "x"}] * turns
    headers = {ps.TASK_HEADER: task, ps.SAMPLE_HEADER: str(sample)}
    if group is not None:
        headers[ps.GROUP_HEADER] = group
    return post(url, "/v1/chat/completions", {"messages": messages}, headers, timeout)


def tool_of(body):
    return body["choices"][0]["message"]["tool_calls"][0]["function"]["name"]


# -- the server ----------------------------------------------------------------------------------
def test_a_hang_turn_submits_unless_hangs_are_asked_for():
    assert ScriptedPolicy(bundled_script()).turn("palindrome", 0, 0) == SUBMIT
    assert ScriptedPolicy(bundled_script(), hangs=True).turn("palindrome", 0, 0) == {"hang": True}
    with running() as server:
        started = time.monotonic()
        status, _, body = ask(server.url, "palindrome")
        assert status == 200 and tool_of(body) == "submit"
        assert time.monotonic() - started < 5
    # A hang answers nothing: the connection is closed once the hang is over.
    with (
        running(hangs=True, hang_seconds=0.2) as server,
        pytest.raises((http.client.HTTPException, OSError)),
    ):
        ask(server.url, "palindrome")


def test_the_slow_fraction_is_about_right_and_the_same_every_time():
    policy = ScriptedPolicy(bundled_script(), turn_seconds=0.5, slow_fraction=0.25, slow_factor=4)
    pairs = [(f"batch-{b}:leap-year", s) for b in range(10) for s in range(20)]
    slow = {pair for pair in pairs if policy.is_slow(*pair)}
    assert 30 <= len(slow) <= 70  # 50 expected; binomial sd about 6
    again = ScriptedPolicy(bundled_script(), slow_fraction=0.25)
    assert slow == {pair for pair in pairs if again.is_slow(*pair)}
    # Another batch picks other samples of the same task.
    by_batch = [{s for g, s in slow if g == f"batch-{b}:leap-year"} for b in range(10)]
    assert len({frozenset(samples) for samples in by_batch}) > 1
    slow_pair, fast_pair = next(iter(slow)), next(p for p in pairs if p not in slow)
    assert policy.turn_wait(*slow_pair) == (2.0, True)
    assert policy.turn_wait(*fast_pair) == (0.5, False)
    assert ScriptedPolicy(bundled_script()).turn_wait(*slow_pair) == (0.0, False)
    with pytest.raises(ValueError, match="slow_fraction"):
        ScriptedPolicy(bundled_script(), slow_fraction=1.5)


def test_slow_samples_wait_longer_and_the_calls_say_so():
    with running(turn_seconds=0.02, slow_fraction=0.5, slow_factor=25) as server:
        policy = server._server.policy
        group = "b1:leap-year"
        slow = next(s for s in range(100) if policy.is_slow(group, s))
        fast = next(s for s in range(100) if not policy.is_slow(group, s))
        seconds = {}
        for sample in (slow, fast):
            started = time.monotonic()
            assert ask(server.url, "leap-year", sample, group)[0] == 200
            seconds[sample] = time.monotonic() - started
        calls = server.calls()
    assert seconds[slow] >= 0.5 and seconds[fast] < 0.4, seconds
    assert [(c["sample"], c["slow"]) for c in calls] == [(slow, True), (fast, False)]


def test_every_answer_carries_the_policy_version_which_post_version_changes():
    with running(version=3) as server:
        status, headers, body = ask(server.url, "leap-year")
        assert status == 200 and headers[ps.VERSION_HEADER] == "3"
        assert body["metadata"] == {"weight_version": "3"}
        assert post(server.url, "/version", {"version": 7})[2] == {"version": 7}
        assert post(server.url, "/version", b"")[2] == {"version": 8}
        assert post(server.url, "/version", {"version": "nine"})[0] == 400
        assert post(server.url, "/version", {"version": True})[0] == 400
        assert server.version == 8
        assert server.bump_version() == 9 and server.set_version(20) == 20
        status, headers, body = ask(server.url, "leap-year", turns=1)
        assert headers[ps.VERSION_HEADER] == "20" and body["metadata"]["weight_version"] == "20"
        assert [c["policy_version"] for c in server.calls()] == [3, 20]


def test_the_command_passes_its_options_to_the_server(monkeypatch):
    seen = {}

    class Fake:
        url = "http://127.0.0.1:1"

        def __init__(self, *args, **kwargs):
            seen.update(args=args, kwargs=kwargs)

        def serve_forever(self):
            pass

    monkeypatch.setattr(ps, "PolicyServer", Fake)
    done = CliRunner().invoke(
        cli_main.cli,
        [
            "policy-server",
            "--hangs",
            "--turn-seconds",
            "0.5",
            "--slow-fraction",
            "0.1",
            "--slow-factor",
            "4",
            "--policy-version",
            "3",
        ],
    )
    assert done.exit_code == 0, done.output
    assert seen["kwargs"] == {
        "hangs": True,
        "turn_seconds": 0.5,
        "slow_fraction": 0.1,
        "slow_factor": 4.0,
        "version": 3,
    }
    refused = CliRunner().invoke(cli_main.cli, ["policy-server", "--slow-fraction", "2"])
    assert refused.exit_code == 2


# -- the runner ----------------------------------------------------------------------------------
IDENTITY = {"task_id": "steps", "sample": 0, "group_id": "b1:steps", "attempt": 0}


def test_policy_version_comes_from_the_header_else_the_body():
    assert episode.policy_version("7", {"metadata": {"weight_version": "1"}}) == "7"
    assert episode.policy_version("", {"weight_version": 4}) == "4"
    assert episode.policy_version(None, {"metadata": {"weight_version": "step-2"}}) == "step-2"
    assert episode.policy_version(None, {"metadata": {"weight_version": True}}) is None
    assert episode.policy_version(None, {"choices": []}) is None
    assert episode.policy_version("v" * 1000, {}) == "v" * episode.MAX_VERSION_CHARS
    assert episode.version_lag("3", "6") == 3 and episode.version_lag("6", "3") == -3
    assert episode.version_lag("step-1", "step-5") is None
    assert episode.version_lag(None, "5") is None


def test_complete_returns_the_version_header(monkeypatch):
    with running(version=5) as server:
        monkeypatch.setenv("ROLLOUT_POLICY_URL", server.url)
        monkeypatch.delenv("ROLLOUT_POLICY_SOCKET", raising=False)
        policy = episode.Policy({"model": "m"}, "ep-1", IDENTITY)
        asked = [{"role": "user", "content": "go"}]
        parsed, raw, attempts, header = policy.complete(asked, episode.TOOLS)
    assert header == "5" and attempts == 1
    assert parsed["metadata"]["weight_version"] == "5" and json.loads(raw) == parsed


def bump_at(server, turn, version):
    """Make the server's policy move to `version` just before it answers turn `turn`."""
    original = server._server.policy.turn

    def turn_hook(task_id, sample, n, bash=False):
        if n == turn:
            server.set_version(version)
        return original(task_id, sample, n, bash)

    server._server.policy.turn = turn_hook


def run_loop(server, tmp_path, monkeypatch, capsys, config):
    monkeypatch.setenv("ROLLOUT_POLICY_URL", server.url)
    monkeypatch.setenv("EPISODE_ID", "ep-1")
    monkeypatch.delenv("ROLLOUT_POLICY_SOCKET", raising=False)
    monkeypatch.delenv("ROLLOUT_READY_FILE", raising=False)
    root = str(tmp_path.resolve())
    episode.write_files(root, TASK["files"])
    runner = episode.Runner(TASK, episode.Policy(config, "ep-1", IDENTITY), IDENTITY, root)
    capsys.readouterr()
    try:
        done, stale = runner.loop(), None
    except episode.StalePolicy as exc:
        done, stale = None, exc
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return done, stale, steps


def test_the_loop_records_each_turns_version_and_runs_on_without_a_bound(
    tmp_path, monkeypatch, capsys
):
    with running(script=STEPS_SCRIPT) as server:
        bump_at(server, 2, 3)
        done, stale, steps = run_loop(server, tmp_path, monkeypatch, capsys, {})
    assert done == (4, "submit") and stale is None
    assert [s["policy_version"] for s in steps] == ["0", "0", "3", "3"]


def test_the_loop_stops_at_the_first_turn_past_the_bound(tmp_path, monkeypatch, capsys):
    with running(script=STEPS_SCRIPT) as server:
        bump_at(server, 2, 3)
        done, stale, steps = run_loop(server, tmp_path, monkeypatch, capsys, {"max_policy_lag": 2})
        calls = server.calls()
    assert done is None and stale is not None
    assert [s["step"] for s in steps] == [1, 2]  # the stale turn's actions never ran
    assert stale.fields == {
        "first_version": "0",
        "version": "3",
        "lag": 3,
        "max_policy_lag": 2,
        "steps": 2,
    }
    assert len(calls) == 3  # no turn asked after the stale one
    with running(script=STEPS_SCRIPT) as server:
        bump_at(server, 2, 2)  # lag 2: within the bound
        done, stale, _ = run_loop(server, tmp_path, monkeypatch, capsys, {"max_policy_lag": 2})
    assert done == (4, "submit") and stale is None


def test_a_stale_episode_exits_0_with_a_stale_event_that_validates_as_stale(tmp_path):
    program = tmp_path / "episode.py"
    program.write_text(episode_program_text())
    (tmp_path / "tasks.json").write_text(json.dumps([TASK]))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with running(script=STEPS_SCRIPT, version=4) as server:
        bump_at(server, 2, 9)
        env = {
            "PATH": os.environ["PATH"],
            "EPISODE_ID": "rollout-b1-0",
            "ROLLOUT_WORKSPACE": str(workspace),
            "ROLLOUT_TASKS_FILE": str(tmp_path / "tasks.json"),
            "ROLLOUT_TASK_ID": "steps",
            "ROLLOUT_SAMPLE": "0",
            "ROLLOUT_GROUP_ID": "b1:steps",
            "ROLLOUT_POLICY": json.dumps({"model": "m", "max_policy_lag": 1}),
            "ROLLOUT_POLICY_URL": server.url,
        }
        started = time.time()
        done = subprocess.run(
            [sys.executable, "-B", str(program)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["event"] for e in events] == ["ready", "step", "step", "stale"]
    assert [e["policy_version"] for e in events[1:3]] == ["4", "4"]
    last = events[-1]
    assert (last["first_version"], last["version"], last["lag"]) == ("4", "9", 5)
    assert (last["max_policy_lag"], last["steps"], last["group_id"]) == (1, 2, "b1:steps")
    obs = EpisodeObservation(
        index=0,
        episode_id="rollout-b1-0",
        phase="Succeeded",
        created_at=started - 1,
        finished_at=time.time() + 1,
        exit_code=0,
    )
    row = validate_episode(obs, done.stdout, started - 2)
    assert row.status == "stale" and row.errors == [] and row.reward == 0
    assert row.failure_kind is None and row.policy_versions == {"first": "4", "last": "4"}
    assert row.failure_cause == "stale: first turn at version 4, policy at 9 (max lag 1)"


def test_a_bash_agent_gets_our_plan_as_shell_commands_that_do_the_same(tmp_path):
    from rollout_worker.cli.policy_server import BASH_DONE, as_bash

    content = "line one\nROLLOUT_EOF inside\n"
    write = as_bash(
        {"tool": "write_file", "arguments": {"path": "pkg/a.py", "content": content}}, {"bash"}
    )
    assert write["tool"] == "bash"
    subprocess.run(["sh", "-c", write["arguments"]["command"]], cwd=tmp_path, check=True)
    assert (tmp_path / "pkg" / "a.py").read_text() == content
    read = as_bash({"tool": "read_file", "arguments": {"path": "pkg/a.py"}}, {"bash"})
    shown = subprocess.run(
        ["sh", "-c", read["arguments"]["command"]], cwd=tmp_path, capture_output=True, text=True
    )
    assert shown.stdout == content
    assert as_bash({"tool": "submit"}, {"bash"})["arguments"]["command"] == BASH_DONE
    # An agent with its own submit tool gets it as it is.
    assert as_bash({"tool": "submit"}, {"bash", "submit"}) == {"tool": "submit"}


def test_a_streamed_answer_is_the_same_answer_in_chunks():
    from rollout_worker.cli.policy_server import completion, stream_chunks

    request = {"messages": [], "logprobs": True, "stream_options": {"include_usage": True}}
    turn = {"tool": "run", "arguments": {"command": "python -m unittest"}}
    body = completion(request, turn, "c1", version=3)
    chunks = stream_chunks(body, request)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    arguments = "".join(
        call["function"].get("arguments", "")
        for c in chunks
        for choice in c["choices"]
        for call in choice["delta"].get("tool_calls", [])
    )
    assert arguments == body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["usage"] == body["usage"] and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[0]["metadata"] == {"weight_version": "3"}
