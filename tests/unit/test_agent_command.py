"""Agent commands in the runner: the recording proxy (whole and streamed answers), the time
limit, the oracle, `file` rewards, grading in a fresh sandbox; their logs validated to rows.

Every run of the runner here names stand-ins for /tests, /solution and /logs/verifier: the
machine's own are never touched."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout_wire.request import REWARD_FILES
from rollout_worker.cli.policy_server import running
from rollout_worker.observation import EpisodeObservation
from rollout_worker.sandbox import episode_program_text
from rollout_worker.validation import validate_episode
from tests.runner_program import episode

EP = "rollout-b1-0"
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
UNIT_TESTS = """import unittest

from calc import add


class AddTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)


if __name__ == "__main__":
    unittest.main()
"""
TASK = {
    "id": "calc",
    "statement": "Fix add in calc.py.",
    "files": {"calc.py": BUGGY},
    "test_files": {"test_calc.py": UNIT_TESTS},
    "test_command": ["python", "-B", "test_calc.py"],
    "time_limit_seconds": 30,
}
WRITE_FIX = {"tool": "write_file", "arguments": {"path": "calc.py", "content": FIXED}}
SCRIPT = {
    "tasks": {
        "calc": {"plans": [[{"tool": "read_file", "arguments": {"path": "calc.py"}}, WRITE_FIX]]}
    }
}
# An agent on nothing but urllib: two chat completions, the policy's write_file carried out.
URLLIB_AGENT = """
import json, os, urllib.request

messages = [{"role": "user", "content": os.environ["ROLLOUT_STATEMENT"]}]
for turn in range(2):
    body = {"model": "whatever", "messages": messages, "temperature": 0.5}
    key = os.environ["OPENAI_API_KEY"]
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer " + key},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        message = json.load(answer)["choices"][0]["message"]
    messages.append(message)
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "write_file":
            with open(arguments["path"], "w") as handle:
                handle.write(arguments["content"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
print("model", os.environ["OPENAI_MODEL"], "flag", os.environ.get("AGENT_FLAG"))
"""


def run_runner(
    tmp_path, task, *, url=None, config=None, phase=None, workspace=None, extra_env=None
):
    """(the finished runner process, its events)."""
    program = tmp_path / "episode.py"
    program.write_text(episode_program_text())
    (tmp_path / "tasks.json").write_text(json.dumps([task]))
    workspace = workspace or tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    root = tmp_path / "root"
    env = {
        "PATH": os.environ["PATH"],
        "EPISODE_ID": EP,
        "ROLLOUT_WORKSPACE": str(workspace),
        "ROLLOUT_TASKS_FILE": str(tmp_path / "tasks.json"),
        "ROLLOUT_TASK_ID": task["id"],
        "ROLLOUT_SAMPLE": "0",
        "ROLLOUT_GROUP_ID": f"b1:{task['id']}",
        "ROLLOUT_TESTS_DIR": str(root / "tests"),
        "ROLLOUT_SOLUTION_DIR": str(root / "solution"),
        "ROLLOUT_VERIFIER_DIR": str(root / "logs" / "verifier"),
    }
    if url is not None:
        env["ROLLOUT_POLICY"] = json.dumps(config or {"model": "m"})
        env["ROLLOUT_POLICY_URL"] = url
    if phase is not None:
        env["ROLLOUT_PHASE"] = phase
    env |= extra_env or {}
    done = subprocess.run(
        [sys.executable, "-B", str(program)], env=env, capture_output=True, text=True, timeout=60
    )
    return done, [json.loads(line) for line in done.stdout.splitlines()]


def row_of(log, started, exit_code=0):
    obs = EpisodeObservation(
        index=0,
        episode_id=EP,
        phase="Succeeded" if exit_code == 0 else "Failed",
        created_at=started - 1,
        finished_at=time.time() + 1,
        exit_code=exit_code,
    )
    return validate_episode(obs, log, started - 2)


def agent_task(tmp_path, source=URLLIB_AGENT, **changes):
    agent = tmp_path / "agent.py"
    agent.write_text(source)
    return (
        TASK | {"agent": {"command": ["python", str(agent)], "env": {"AGENT_FLAG": "on"}}} | changes
    )


def baseline_of(pending):
    """What the backend hands a grading sandbox: the baseline counts of its grade_pending."""
    return {episode.BASELINE_TESTS_ENV: json.dumps(pending["baseline_tests"])}


def names(events):
    return [e["event"] for e in events]


def test_an_agent_command_reaches_the_policy_through_the_recording_proxy(tmp_path):
    task = agent_task(tmp_path)
    config = {"model": "policy-m", "sampling": {"temperature": 1.0, "top_p": 0.9}}
    started = time.time()
    with running(script=SCRIPT, version=3) as server:
        done, events = run_runner(tmp_path, task, url=server.url, config=config)
        calls = server.calls()
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events) == ["ready", "step", "step", "agent_exit", "reward"]
    ready, first, second, exit_, reward = events
    assert ready["mode"] == "command" and ready["agent_command"] == task["agent"]["command"]
    assert ready["policy_base_url"].endswith(f"/rollout/{EP}/v1")
    # The agent's conversation, on the batch's model and sampling: its own temperature is
    # refused, and the step says so. The token view's fields are asked on the trainer's behalf.
    assert first["request"] == {
        "model": "policy-m",
        "temperature": 1.0,
        "top_p": 0.9,
        "return_token_ids": True,
        "logprobs": True,
    }
    assert first["request_refused"] == ["temperature"]
    # The server's ids, stored once: the second turn's prompt extends the first exchange.
    assert first["tokens"]["prompt_reused"] == 0 and first["tokens"]["completion_ids"]
    assert second["tokens"]["prompt_reused"] == len(first["tokens"]["prompt_ids"]) + len(
        first["tokens"]["completion_ids"]
    )
    assert first["new_messages"] == [{"role": "user", "content": "Fix add in calc.py."}]
    assert first["messages_reset"] is False and first["stream"] is False
    assert first["status"] == 200 and first["error"] is None and first["policy_version"] == "3"
    assert first["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
        "read_file"
    )
    assert (first["group_id"], first["task_id"], first["episode_id"]) == ("b1:calc", "calc", EP)
    # The second exchange shows only what the agent added: the answer and its tool result.
    assert [m["role"] for m in second["new_messages"]] == ["assistant", "tool"]
    assert second["messages_reset"] is False and second["step"] == 2
    assert exit_["exit_code"] == 0 and exit_["timed_out"] is False
    assert exit_["output_tail"] == "model policy-m flag on"
    assert (reward["reward"], reward["tests_exit"], reward["baseline_exit"]) == (1, 0, 1)
    assert (reward["steps"], reward["stop_reason"], reward["agent_exit_code"]) == (
        2,
        "agent_exit",
        0,
    )
    assert [c["path"] for c in calls] == [f"/rollout/{EP}/v1/chat/completions"] * 2
    assert {(c["group_id"], c["task_id"], c["header_episode_id"]) for c in calls} == {
        ("b1:calc", "calc", EP)
    }
    assert (tmp_path / "ws" / "calc.py").read_text() == FIXED
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.errors == [] and row.reward == 1
    assert (row.steps, row.stop_reason, row.agent_exit_code) == (2, "agent_exit", 0)
    assert row.agent_output == "model policy-m flag on" and row.agent_seconds > 0
    assert row.policy_versions == {"first": "3", "last": "3"}


# -- streamed answers ----------------------------------------------------------------------------
ARGUMENTS = json.dumps({"path": "calc.py", "content": FIXED})
CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "Fix"},
                "logprobs": {"content": [{"token": "Fix", "logprob": -0.5}]},
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "ing."},
                "logprobs": {"content": [{"token": "ing.", "logprob": -0.25}]},
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "write_file", "arguments": ""},
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ARGUMENTS[:20]}}]},
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ARGUMENTS[20:]}}]},
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
]
STREAM_AGENT = """
import json, os, urllib.request

body = {"model": "x", "stream": True, "messages": [{"role": "user", "content": "go"}],
        "stream_options": {"include_usage": True}}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
    {"Content-Type": "application/json"},
)
arguments, chunks, done = "", 0, False
with urllib.request.urlopen(request, timeout=30) as answer:
    for line in answer:
        line = line.strip()
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: "):
            chunks += 1
            for choice in json.loads(line[6:])["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    arguments += call["function"].get("arguments") or ""
call = json.loads(arguments)
with open(call["path"], "w") as handle:
    handle.write(call["content"])
print("chunks", chunks, "done", done)
"""


class SSEHandler(BaseHTTPRequestHandler):
    """A policy that streams CHUNKS (and nothing else), framed by chunked encoding or by
    closing the connection."""

    protocol_version = "HTTP/1.1"
    framing = "close"
    seen: list = []

    def log_message(self, format, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, dict(self.headers), body))
        events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in CHUNKS]
        events.append(b"data: [DONE]\n\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-Policy-Version", "7")
        if self.framing == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        for data in events:
            if self.framing == "chunked":
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            else:
                self.wfile.write(data)
            self.wfile.flush()
        if self.framing == "chunked":
            self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True


@pytest.mark.parametrize("framing", ["close", "chunked"])
def test_a_streamed_answer_reaches_the_agent_and_is_recorded_assembled(tmp_path, framing):
    handler = type("Handler", (SSEHandler,), {"framing": framing, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started = time.time()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done, events = run_runner(tmp_path, agent_task(tmp_path, STREAM_AGENT), url=url)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events) == ["ready", "step", "agent_exit", "reward"]
    step = events[1]
    assert step["stream"] is True and step["chunks"] == len(CHUNKS)
    assert step["policy_version"] == "7" and step["status"] == 200
    assert step["request"]["stream"] is True and step["request"]["model"] == "m"
    assert step["response"] == {
        "object": "chat.completion",
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Fixing.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "write_file", "arguments": ARGUMENTS},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
                "logprobs": {
                    "content": [
                        {"token": "Fix", "logprob": -0.5},
                        {"token": "ing.", "logprob": -0.25},
                    ]
                },
            }
        ],
    }
    # The agent got every chunk and the [DONE] as the policy sent them.
    assert events[2]["output_tail"] == f"chunks {len(CHUNKS)} done True"
    assert events[3]["reward"] == 1
    path, headers, body = handler.seen[0]
    assert (
        path == f"/rollout/{EP}/v1/chat/completions" and headers["X-Rollout-Group-Id"] == "b1:calc"
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert row_of(done.stdout, started).status == "ok"


def test_stream_assembly_merges_choices_tool_calls_token_ids_and_metadata():
    chunks = [
        {"id": "c", "model": "m", "created": 5, "prompt_token_ids": [1, 2]},
        {"choices": [{"index": 1, "delta": {"role": "assistant", "content": "B"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "thi"}, "token_ids": [7]}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "nk"}, "token_ids": [8, 9]}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 1, "id": "b", "function": {"name": "run", "arguments": "{"}},
                            {"index": 0, "id": "a", "function": {"name": "read", "arguments": ""}},
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]},
                    "finish_reason": "tool_calls",
                }
            ],
            "metadata": {"weight_version": "4"},
        },
    ]
    whole = episode.assemble_stream(chunks)
    assert whole["id"] == "c" and whole["prompt_token_ids"] == [1, 2]
    assert whole["metadata"] == {"weight_version": "4"}
    assert episode.policy_version(None, whole) == "4"
    first, second = whole["choices"]
    assert first["token_ids"] == [7, 8, 9] and first["finish_reason"] == "tool_calls"
    assert first["message"]["reasoning_content"] == "think" and first["message"]["content"] is None
    assert [c["id"] for c in first["message"]["tool_calls"]] == ["a", "b"]
    assert first["message"]["tool_calls"][1]["function"] == {"name": "run", "arguments": "{}"}
    assert second == {
        "index": 1,
        "message": {"role": "assistant", "content": "B"},
        "finish_reason": None,
    }


def test_the_event_stream_parser_splits_events_across_reads():
    stream = episode.EventStream()
    assert stream.feed(b'data: {"a"') == []
    found = stream.feed(b': 1}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\ndata: {"b": 2}')
    assert [done for _, done in found] == [False, False, True]
    assert found[0][0] == b'data: {"a": 1}\r\n\r\n'
    assert stream.chunks == [{"a": 1}] and stream.buffer == b'data: {"b": 2}'


# -- what the proxy records ----------------------------------------------------------------------
def test_the_proxy_records_new_messages_resets_and_fits_big_steps(monkeypatch, capsys):
    monkeypatch.setenv("EPISODE_ID", EP)
    monkeypatch.setenv("ROLLOUT_POLICY_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("ROLLOUT_POLICY_SOCKET", raising=False)
    monkeypatch.delenv("ROLLOUT_READY_FILE", raising=False)
    identity = {"task_id": "calc", "sample": 0, "group_id": "b1:calc", "attempt": 0}
    proxy = episode.Proxy(episode.Policy({"model": "m"}, EP, identity), identity)
    answer = episode.Answer(200, b"{}", None, 1, "application/json")
    user, reply, tool = (
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "tool_call_id": "1", "content": "t"},
    )
    capsys.readouterr()
    try:
        for messages in ([user], [user, reply, tool], [user]):
            proxy.record({"model": "m", "messages": messages}, time.time(), answer, response={})
        big = {"role": "tool", "tool_call_id": "2", "content": "x" * (400 * 1024)}
        proxy.record({"model": "m", "messages": [user, big]}, time.time(), answer, response={})
    finally:
        proxy.close()
    lines = capsys.readouterr().out.splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["new_messages"] for s in steps[:3]] == [[user], [reply, tool], [user]]
    assert [s["messages_reset"] for s in steps] == [False, False, True, False]
    assert max(len(line.encode()) for line in lines) <= episode.MAX_STEP_EVENT_BYTES
    cut = steps[3]["new_messages"][0]["content"]
    assert steps[3]["messages_truncated"] is True and "bytes truncated" in cut


def test_the_proxy_answers_models_and_refuses_what_is_no_chat_completion(monkeypatch):
    monkeypatch.setenv("ROLLOUT_POLICY_URL", "http://127.0.0.1:9")
    identity = {"task_id": "calc", "sample": 0, "group_id": "b1:calc", "attempt": 0}
    proxy = episode.Proxy(episode.Policy({"model": "m"}, EP, identity), identity).start()
    try:
        with urllib.request.urlopen(proxy.base_url + "/models", timeout=10) as answer:
            assert json.load(answer)["data"][0]["id"] == "m"
        for path, body, status in (
            ("/completions", b"{}", 404),
            ("/chat/completions", b"not json", 400),
            ("/chat/completions", b'{"model": "m"}', 400),
        ):
            request = urllib.request.Request(proxy.base_url + path, body)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == status
    finally:
        proxy.close()
    assert proxy.steps == 0 and proxy.failure is None


# -- limits and failures -------------------------------------------------------------------------
HANGING_AGENT = """
import signal, subprocess, sys, time

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
child = subprocess.Popen(sleep)
escaped = subprocess.Popen(sleep, start_new_session=True)  # out of the agent's group
with open("pids", "w") as handle:
    handle.write(f"{child.pid} {escaped.pid}")
print("waiting", flush=True)
time.sleep(120)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_an_agent_past_its_time_limit_is_killed_with_all_it_started(tmp_path):
    task = agent_task(tmp_path, HANGING_AGENT, time_limit_seconds=1)
    started = time.time()
    with running(script=SCRIPT) as server:
        done, events = run_runner(tmp_path, task, url=server.url)
    pids = [int(p) for p in (tmp_path / "ws" / "pids").read_text().split()]
    try:
        deadline = time.time() + 5
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events) == ["ready", "agent_exit", "reward"]
    exit_, reward = events[1], events[2]
    assert exit_["exit_code"] is None and exit_["timed_out"] is True
    assert 1 <= exit_["seconds"] < 10 and exit_["output_tail"] == "waiting"
    assert (reward["reward"], reward["stop_reason"], reward["agent_exit_code"]) == (
        0,
        "time_limit",
        None,
    )
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.reward == 0 and row.stop_reason == "time_limit"
    assert row.agent_exit_code is None and row.steps == 0


def test_a_policy_past_the_lag_bound_stops_the_agent_and_the_episode_is_stale(tmp_path):
    started = time.time()
    with running(script=SCRIPT, version=2) as server:
        original = server._server.policy.turn

        def bump(task_id, sample, n, **options):
            if n == 1:
                server.set_version(5)
            return original(task_id, sample, n, **options)

        server._server.policy.turn = bump
        config = {"model": "m", "max_policy_lag": 1}
        done, events = run_runner(tmp_path, agent_task(tmp_path), url=server.url, config=config)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events) == ["ready", "step", "agent_exit", "stale"]
    stale = events[-1]
    assert (stale["first_version"], stale["version"], stale["lag"], stale["steps"]) == (
        "2",
        "5",
        3,
        1,
    )
    assert (tmp_path / "ws" / "calc.py").read_text() == BUGGY  # the stale answer never arrived
    row = row_of(done.stdout, started)
    assert row.status == "stale" and row.errors == [] and row.reward == 0


def test_an_unreachable_policy_ends_the_episode_as_an_infrastructure_error(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    started = time.time()
    config = {"model": "m", "max_retries": 0, "request_timeout_seconds": 5}
    done, events = run_runner(
        tmp_path, agent_task(tmp_path), url=f"http://127.0.0.1:{port}", config=config
    )
    assert done.returncode == episode.EXIT_INFRASTRUCTURE and done.stderr == "", done.stderr
    assert names(events) == ["ready", "step", "agent_exit", "error"]
    step = events[1]
    assert step["status"] is None and step["response"] is None
    assert "unreachable" in step["error"] and events[-1]["kind"] == "infrastructure"
    row = row_of(done.stdout, started, exit_code=episode.EXIT_INFRASTRUCTURE)
    assert row.status == "failed" and row.failure_kind == "infrastructure"


def stalling(server, hang, answer=0.0):
    """Make the scripted policy hang `hang` s on the first call of each turn in `hangs` and
    take `answer` s on the call that answers: the runner's first attempt times out, its retry
    is answered."""
    original = server._server.policy.turn
    seen: set = set()

    def turn(task_id, sample, n, **options):
        if n in hang and n not in seen:
            seen.add(n)
            time.sleep(3)  # past the request timeout: the runner has given up on this one
        elif n in hang:
            time.sleep(answer)
        return original(task_id, sample, n, **options)

    server._server.policy.turn = turn


STALL = {"model": "m", "request_timeout_seconds": 2, "max_retries": 1}


@pytest.mark.parametrize("agent", ["loop", "command"])
def test_a_stalled_policy_request_does_not_eat_the_agents_time(tmp_path, agent):
    # The first turn: an attempt that times out (2 s), the retry's wait (0.5 s), an answer in
    # 0.7 s: 3.2 s, past the 3 s limit. Without the failed attempt's time given back, the
    # agent would stop on its limit after that turn and be graded 0 for the endpoint's stall.
    task = TASK | {"time_limit_seconds": 3}
    if agent == "command":
        task = agent_task(tmp_path, time_limit_seconds=3)
    started = time.time()
    with running(script=SCRIPT) as server:
        stalling(server, hang={0}, answer=0.7)
        done, events = run_runner(tmp_path, task, url=server.url, config=STALL)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    steps = [e for e in events if e["event"] == "step"]
    assert steps[0]["policy_attempts"] == 2 and steps[0]["policy_seconds"] > 3
    reward = events[-1]
    assert reward["event"] == "reward" and reward["reward"] == 1
    assert reward["stop_reason"] == ("submit" if agent == "loop" else "agent_exit")
    assert 2.4 < reward["cost"]["policy_retry_seconds"] < 3
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.reward == 1
    assert row.cost["policy_retry_seconds"] == reward["cost"]["policy_retry_seconds"]


def test_failed_attempts_longer_than_the_time_limit_are_an_infrastructure_failure(tmp_path):
    # Every turn's first attempt times out (2 s + 0.5 s): after two turns 5 s are lost, more
    # than the 2 s limit can give back. Not a reward: retried in a fresh sandbox.
    task = TASK | {"time_limit_seconds": 2}
    started = time.time()
    with running(script=SCRIPT) as server:
        stalling(server, hang={0, 1, 2})
        done, events = run_runner(tmp_path, task, url=server.url, config=STALL)
    assert done.returncode == episode.EXIT_INFRASTRUCTURE and done.stderr == "", done.stderr
    assert names(events) == ["ready", "step", "step", "error"]
    error = events[-1]
    assert error["kind"] == "infrastructure" and "did not get its time" in error["cause"]
    assert error["cost"]["policy_retry_seconds"] > 4
    row = row_of(done.stdout, started, exit_code=episode.EXIT_INFRASTRUCTURE)
    assert row.status == "failed" and row.failure_kind == "infrastructure" and row.reward == 0


def test_a_connection_the_endpoint_never_accepts_is_given_up_after_the_connect_timeout(tmp_path):
    # A listener whose accept queue is full drops new SYNs, as a stalled path does: the runner
    # gives up after CONNECT_TIMEOUT_SECONDS, not after the request timeout of 30 s.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())  # the one connection the queue holds
        config = {"model": "m", "request_timeout_seconds": 30, "max_retries": 0}
        url = "http://{}:{}".format(*listener.getsockname())
        started = time.time()
        done, events = run_runner(tmp_path, TASK, url=url, config=config)
        took = time.time() - started
    assert done.returncode == episode.EXIT_INFRASTRUCTURE, done.stderr
    error = events[-1]
    assert error["kind"] == "infrastructure"
    assert f"no connection within {episode.CONNECT_TIMEOUT_SECONDS:g}s" in error["cause"]
    assert episode.CONNECT_TIMEOUT_SECONDS <= took < 20


def test_an_agent_command_that_is_not_there_is_an_episode_error(tmp_path):
    task = TASK | {"agent": {"command": ["no-such-agent-anywhere"]}}
    with running(script=SCRIPT) as server:
        done, events = run_runner(tmp_path, task, url=server.url)
    assert done.returncode == episode.EXIT_EPISODE_ERROR and done.stderr == ""
    assert names(events) == ["ready", "error"] and events[-1]["kind"] == "episode"
    assert "no-such-agent-anywhere" in events[-1]["cause"]


# -- the oracle and file rewards -----------------------------------------------------------------
SOLVE = f"#!/bin/bash\nset -e\ncat > calc.py <<'END'\n{FIXED}END\necho solved\n"


def oracle_task(test_script, **changes):
    return {
        "id": "calc",
        "statement": "Fix add in calc.py.",
        "files": {"calc.py": BUGGY},
        "test_files": {"test_calc.py": UNIT_TESTS},
        "tests": {"test.sh": test_script},
        "solution": {"solve.sh": SOLVE},
        "test_command": ["bash", "/tests/test.sh"],
        "reward": "file",
        "agent": "oracle",
        "time_limit_seconds": 30,
    } | changes


PASS_THEN_WRITE = (
    "#!/bin/bash\n"
    'cd "$ROLLOUT_WORKSPACE"\n'
    "python -B test_calc.py || exit 1\n"
    "cat > \"$ROLLOUT_VERIFIER_DIR/{name}\" <<'END'\n{text}\nEND\n"
)


def test_the_oracle_runs_the_solution_and_the_tests_come_only_for_grading(tmp_path):
    script = PASS_THEN_WRITE.format(name="reward.txt", text="1")
    started = time.time()
    done, events = run_runner(tmp_path, oracle_task(script))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events) == ["ready", "agent_exit", "reward"]
    ready, exit_, reward = events
    assert ready["mode"] == "oracle" and "policy_base_url" not in ready
    assert exit_["exit_code"] == 0 and exit_["output_tail"] == "solved"
    assert (reward["reward"], reward["reward_rule"], reward["baseline_exit"]) == (1.0, "file", None)
    assert (reward["tests_exit"], reward["steps"]) == (0, 0)
    tests = tmp_path / "root" / "tests" / "test.sh"
    assert os.access(tests, os.X_OK)  # a script: made executable
    assert (tmp_path / "root" / "solution" / "solve.sh").exists()
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.reward == 1.0 and row.baseline_exit is None


@pytest.mark.parametrize(
    ("name", "text", "reward", "details"),
    [
        ("reward.txt", "0.25", 0.25, None),
        ("reward.json", '{"reward": 0.5, "accuracy": 0.75, "passed": 3, "note": "x"}', 0.5,
         {"accuracy": 0.75, "passed": 3.0}),
        ("reward.json", '{"score": 2}', 2, None),  # not binary: kept as written
    ],
)  # fmt: skip
def test_a_file_reward_is_read_as_the_tests_wrote_it(tmp_path, name, text, reward, details):
    started = time.time()
    done, events = run_runner(tmp_path, oracle_task(PASS_THEN_WRITE.format(name=name, text=text)))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    outcome = events[-1]
    assert (outcome["reward"], outcome["reward_details"]) == (reward, details)
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.reward == reward and row.reward_details == details


def test_a_missing_reward_file_is_reward_0_even_when_the_agent_planted_one(tmp_path):
    planted = tmp_path / "root" / "logs" / "verifier" / "reward.txt"
    solve = SOLVE + f"mkdir -p {planted.parent}\necho 1 > {planted}\n"
    task = oracle_task("#!/bin/bash\ntrue\n", solution={"solve.sh": solve})
    started = time.time()
    done, events = run_runner(tmp_path, task)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events) == ["ready", "agent_exit", "reward"]
    outcome = events[-1]
    assert (outcome["reward"], outcome["grade_cause"], outcome["graded_by"]) == (
        0,
        "no_reward_file",
        "reward_file",
    )
    assert "reward.txt" in outcome["tests_output"] and "reward.json" in outcome["tests_output"]
    assert not planted.exists()  # emptied before the tests ran
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.reward == 0 and row.grade_cause == "no_reward_file"


def test_the_runner_reads_the_reward_files_the_request_names_in_their_order(tmp_path):
    names = [os.path.join(episode.VERIFIER_DIR, n) for n in episode.REWARD_FILE_NAMES]
    assert tuple(names) == REWARD_FILES
    (tmp_path / "reward.txt").write_text("0.25")
    (tmp_path / "reward.json").write_text('{"reward": 0.75}')
    first = os.path.basename(REWARD_FILES[0])
    assert episode.read_reward(str(tmp_path))[0] == (0.75 if first == "reward.json" else 0.25)


def test_reward_files_are_parsed_strictly(tmp_path):
    def read(name, text):
        for old in tmp_path.iterdir():
            old.unlink()
        (tmp_path / name).write_text(text)
        return episode.read_reward(str(tmp_path))

    assert read("reward.txt", " 0.5\n") == (0.5, None)
    assert read("reward.json", "0.5") == (0.5, None)
    assert read("reward.json", '{"pass": 1, "label": "x"}') == (1, None)
    for name, text in (
        ("reward.txt", "nan"),
        ("reward.txt", "1\n2"),
        ("reward.txt", ""),
        ("reward.json", "{"),
        ("reward.json", '{"a": 1, "b": 2}'),
        ("reward.json", '{"reward": "1"}'),
        ("reward.json", '{"reward": true}'),
        ("reward.json", '{"reward": Infinity}'),
        ("reward.json", '{"reward": NaN}'),
        ("reward.json", '{"reward": ' + "9" * 400 + "}"),
        ("reward.json", '{"reward": 1e309}'),
        ("reward.json", '{"reward": 1e308}'),
        ("reward.txt", "1e308"),
        ("reward.txt", "inf"),
        ("reward.txt", " " * (episode.MAX_REWARD_FILE_BYTES + 1) + "1"),
    ):
        with pytest.raises(episode.RewardFileProblem, match=name) as raised:
            read(name, text)
        assert raised.value.cause == "reward_file_invalid"
    for old in tmp_path.iterdir():
        old.unlink()
    os.mkfifo(tmp_path / "reward.txt")  # would block a plain open
    with pytest.raises(episode.RewardFileProblem, match="not a regular file"):
        episode.read_reward(str(tmp_path))
    os.unlink(tmp_path / "reward.txt")
    (tmp_path / "reward.txt").symlink_to("/etc/hostname")
    with pytest.raises(episode.RewardFileProblem, match="cannot be read"):
        episode.read_reward(str(tmp_path))


def test_files_are_written_through_nothing_an_agent_left_in_the_way(tmp_path):
    root = tmp_path / "ws"
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "test_a.py").symlink_to(outside)
    (root / "test_b.py").mkdir()
    (root / "sub").symlink_to(tmp_path)
    files = {"pkg/test_a.py": "a", "test_b.py": "b", "sub/test_c.py": "c"}
    episode.write_files(str(root), files)
    assert outside.read_text() == "keep" and not (tmp_path / "test_c.py").exists()
    assert {p: (root / p).read_text() for p in files} == files
    assert not (root / "sub").is_symlink()
    with pytest.raises(ValueError):
        episode.write_files(str(root), {"../x": "y"})


# -- grading in a fresh sandbox ------------------------------------------------------------------
def test_grade_fresh_runs_the_tests_in_a_second_phase_and_the_two_logs_make_one_row(tmp_path):
    task = agent_task(tmp_path, grade="fresh")
    started = time.time()
    with running(script=SCRIPT) as server:
        first, agent_events = run_runner(tmp_path, task, url=server.url)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert names(agent_events) == ["ready", "step", "step", "agent_exit", "grade_pending"]
    pending = agent_events[-1]
    assert (pending["steps"], pending["stop_reason"], pending["baseline_exit"]) == (
        2,
        "agent_exit",
        1,
    )
    copy = tmp_path / "graded"
    shutil.copytree(tmp_path / "ws", copy)
    (tmp_path / "ws" / "calc.py").write_text(BUGGY)  # the grader sees only its copy
    second, grade_events = run_runner(
        tmp_path, task, phase="grade", workspace=copy, extra_env=baseline_of(pending)
    )
    assert second.returncode == 0 and second.stderr == "", second.stderr
    assert names(grade_events) == ["ready", "reward"]
    assert grade_events[0]["mode"] == "grade" and grade_events[1]["grade"] == "fresh"
    assert grade_events[1]["reward"] == 1
    row = row_of(first.stdout + second.stdout, started)
    assert row.status == "ok" and row.errors == [] and row.reward == 1
    assert (row.steps, row.stop_reason, row.baseline_exit, row.agent_exit_code) == (
        2,
        "agent_exit",
        1,
        0,
    )
    assert row.ready_at == agent_events[0]["at"] and row.reward_at == grade_events[1]["at"]
    alone = row_of(first.stdout, started)
    assert alone.status == "failed" and "two ready events" in alone.errors[0]


def test_the_built_in_loop_can_be_graded_fresh_too(tmp_path):
    task = TASK | {"grade": "fresh"}
    started = time.time()
    with running(script=SCRIPT) as server:
        first, agent_events = run_runner(tmp_path, task, url=server.url)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert names(agent_events) == ["ready", "step", "step", "step", "grade_pending"]
    assert agent_events[0]["mode"] == "agent" and agent_events[-1]["stop_reason"] == "submit"
    copy = tmp_path / "graded"
    shutil.copytree(tmp_path / "ws", copy)
    second, grade_events = run_runner(
        tmp_path, task, phase="grade", workspace=copy, extra_env=baseline_of(agent_events[-1])
    )
    assert names(grade_events) == ["ready", "reward"] and grade_events[1]["reward"] == 1
    row = row_of(first.stdout + second.stdout, started)
    assert row.status == "ok" and row.errors == [] and (row.steps, row.reward) == (3, 1)


def test_the_batch_sampling_wins_over_whatever_the_agent_asks_for():
    asked = {
        "model": "other",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [],
        "stream": True,
        "max_tokens": 64,
        "temperature": 2.0,
        "n": 16,
        "logit_bias": {"1": 100},
        "min_tokens": 10**6,
        "top_logprobs": 20,
        "lora_path": "/adapters/cheat",
        "response_format": {"type": "json_object"},
        "seed": 7,
    }
    sent, refused = episode.agent_request(asked, {"temperature": 1.0, "logprobs": True}, "pol")
    assert sent == {
        "model": "pol",
        "messages": asked["messages"],
        "tools": [],
        "stream": True,
        "max_tokens": 64,
        "temperature": 1.0,
        "logprobs": True,
    }
    assert refused == sorted(set(asked) - {"model", "messages", "tools", "stream", "max_tokens"})
