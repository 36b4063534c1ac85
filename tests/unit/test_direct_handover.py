"""The direct hand-over of warm Pods (kube/handover.py, the runner's wait_for_handover):
pool manifests and policy in direct mode, the setting, the runner's port against real sockets
(hostile connections refused, the listener closed before the episode), the worker's send and
its fallback to attach."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from rollout_wire.errors import ConfigError
from rollout_wire.request import parse_spec
from rollout_wire.states import EVENT_KEY_MARK
from rollout_worker.backends import warm
from rollout_worker.backends.kube import handover, objects, pools
from rollout_worker.backends.kube.pools import Claimed, WarmPools
from rollout_worker.sandbox import episode_program_text as program_text
from rollout_worker.settings import Settings
from tests.runner_program import episode

TOKEN_ENV, PORT_ENV = objects.HANDOVER_TOKEN_ENV, objects.HANDOVER_PORT_ENV


def spec(**changes: Any) -> Any:
    fields = {"count": 2, "backend": "kubernetes", "batch_id": "b1", **changes}
    return parse_spec(fields, max_episodes=100)


# -- manifests, policy, setting -----------------------------------------------------------------


def test_the_runner_and_the_worker_agree_on_the_variables_and_the_ack():
    assert (episode.HANDOVER_TOKEN_ENV, episode.HANDOVER_PORT_ENV) == (TOKEN_ENV, PORT_ENV)
    assert episode.HANDOVER_ACK == handover.ACK


def test_a_direct_mode_pool_pod_gets_the_port_and_its_token_and_an_attach_one_neither():
    s = spec()
    plain = objects.pool_pod_manifest(s, "k", 60)
    direct = objects.pool_pod_manifest(s, "k", 60, handover_token="t0k")
    (container,) = direct["spec"]["containers"]
    assert container["ports"] == [
        {"name": "handover", "containerPort": objects.HANDOVER_PORT, "protocol": "TCP"}
    ]
    env = [e for e in container["env"] if e["name"] in (TOKEN_ENV, PORT_ENV)]
    assert env == [
        {"name": PORT_ENV, "value": str(objects.HANDOVER_PORT)},
        {"name": TOKEN_ENV, "value": "t0k"},
    ]
    # Everything else is the attach-mode Pod's, which has neither.
    (bare,) = plain["spec"]["containers"]
    assert "ports" not in bare and not {e["name"] for e in bare["env"]} & {TOKEN_ENV, PORT_ENV}
    del container["ports"]
    container["env"] = [e for e in container["env"] if e not in env]
    assert direct == plain


def test_the_handover_policy_opens_one_port_to_one_cidr_and_nothing_else():
    assert objects.pool_handover_policy("k", "10.89.0.1/32") == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "warm-handover",
            "namespace": objects.pool_namespace("k"),
            "labels": objects.pool_labels("k"),
        },
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"ipBlock": {"cidr": "10.89.0.1/32"}}],
                    "ports": [{"protocol": "TCP", "port": objects.HANDOVER_PORT}],
                }
            ],
        },
    }
    # The pool's own deny-all is unchanged: no ingress at all.
    assert "ingress" not in objects.pool_network_policy(spec(), "k")["spec"]


def test_the_handover_cidr_setting_is_read_and_a_bad_one_refused_at_start():
    assert Settings.from_env({}).warm_handover_from is None
    assert Settings.from_env({"ROLLOUT_WARM_HANDOVER_FROM": ""}).warm_handover_from is None
    on = Settings.from_env({"ROLLOUT_WARM_HANDOVER_FROM": "10.89.0.1/32"})
    assert on.warm_handover_from == "10.89.0.1/32"
    for bad in ("nope", "10.89.0.1/24", "10.89.0.0/33"):
        with pytest.raises(ConfigError, match="ROLLOUT_WARM_HANDOVER_FROM"):
            Settings.from_env({"ROLLOUT_WARM_HANDOVER_FROM": bad})


def test_hand_over_threads_default_by_the_hand_over_and_an_explicit_count_wins():
    # bench_warm: direct, 4 threads meet the 100 ms p50 that 32 miss; attach keeps 32.
    assert Settings.from_env({}).warm_handover_threads_used == 32
    direct = {"ROLLOUT_WARM_HANDOVER_FROM": "10.89.0.1/32"}
    assert Settings.from_env(direct).warm_handover_threads_used == 4
    for env in ({}, direct):
        chosen = Settings.from_env(env | {"ROLLOUT_WARM_HANDOVER_THREADS": "9"})
        assert chosen.warm_handover_threads_used == 9
    with pytest.raises(ConfigError, match="ROLLOUT_WARM_HANDOVER_THREADS"):
        Settings.from_env({"ROLLOUT_WARM_HANDOVER_THREADS": "0"})


class _Api:
    """Any client method: returns its own name and arguments (for _Calls)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: (name, args, kwargs)


class _Calls:
    def __init__(self, log_text: str = "") -> None:
        self.made: list[tuple[str, tuple]] = []
        self.log_text = log_text

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        name, args, _ = fn(*args, **kwargs)
        self.made.append((name, args))
        return {"items": []} if name.startswith("list_") else {}

    def text(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> str:
        self.made.append((fn(*args, **kwargs)[0], args))
        return self.log_text


def _pools(calls: _Calls, handover_from: str | None) -> WarmPools:
    api: Any = _Api()
    return WarmPools(calls.call, calls.text, api, api, 4, handover_from)


@pytest.mark.parametrize("direct", [False, True])
def test_a_fill_in_direct_mode_makes_the_policy_first_and_a_token_per_pod(direct):
    calls = _Calls()
    _pools(calls, "10.89.0.1/32" if direct else None).fill(spec(), "k", 3, 64, 60)
    made = [name for name, _ in calls.made if name.startswith("create_")]
    pods = [args[1] for name, args in calls.made if name == "create_namespaced_pod"]
    assert len(pods) == 3
    tokens = {
        e["value"]
        for p in pods
        for e in p["spec"]["containers"][0]["env"]
        if e["name"] == TOKEN_ENV
    }
    if direct:
        assert made[0] == "create_namespaced_network_policy"
        assert [a[1] for n, a in calls.made if n == made[0]] == [
            objects.pool_handover_policy("k", "10.89.0.1/32")
        ]
        assert len(tokens) == 3 and all(len(t) == 32 for t in tokens)
    else:
        assert "create_namespaced_network_policy" not in made and not tokens


def test_only_a_pod_with_an_ip_and_a_token_is_a_direct_target():
    pod = objects.pool_pod_manifest(spec(), "k", 60, handover_token="abc")
    assert handover.direct_target(pod) is None  # no IP yet
    pod["status"] = {"podIP": "10.89.0.7"}
    target = handover.direct_target(pod)
    assert target == handover.Direct("10.89.0.7", objects.HANDOVER_PORT, "abc")
    assert "abc" not in repr(target)
    plain = objects.pool_pod_manifest(spec(), "k", 60) | {"status": {"podIP": "10.89.0.7"}}
    assert handover.direct_target(plain) is None  # filled by an attach-only worker


# -- the runner's side: real sockets --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Runner:
    """wait_for_handover on a thread, its stdin a real pipe."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
        self.port = _free_port()
        read, self.stdin_w = os.pipe()
        self.stdin = open(read, encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.environ = {TOKEN_ENV: "s3cret", PORT_ENV: str(self.port), **env}
        monkeypatch.setattr(os, "environ", self.environ)
        self.result: list[bool] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append(episode.wait_for_handover(self.stdin)), daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.listening():
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except ConnectionRefusedError:
            return False
        return True

    def send(self, data: bytes, *, close_write: bool = True) -> bytes:
        """What the runner answers before it closes the connection."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as conn:
            conn.sendall(data)
            if close_write:
                conn.shutdown(socket.SHUT_WR)
            answer = b""
            # A runner that closes with our bytes unread resets the connection: closed too.
            with contextlib.suppress(ConnectionResetError):
                while chunk := conn.recv(100):
                    answer += chunk
            return answer

    def done(self) -> bool:
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.result[0]

    def close(self) -> None:
        os.close(self.stdin_w)
        self.stdin.close()


def _line(**env: str) -> bytes:
    return json.dumps({"env": {"ROLLOUT_ACTION": "fix", **env}}).encode() + b"\n"


@pytest.fixture
def runner(monkeypatch):
    made: list[_Runner] = []
    yield lambda env=None: made.append(_Runner(monkeypatch, env or {})) or made[-1]
    for r in made:
        r.close()


def test_a_good_token_and_line_is_taken_acked_and_the_port_closed_before_it_returns(runner):
    r = runner()
    # The token left the environment at once: the agent, started later, never sees it.
    assert TOKEN_ENV not in r.environ and PORT_ENV not in r.environ
    assert r.send(b"s3cret\n" + _line(ROLLOUT_BATCH_ID="b7")) == b"ok\n"
    assert r.done() is True
    assert r.environ["ROLLOUT_BATCH_ID"] == "b7"
    assert not r.listening()  # the listener is gone: a second connection is refused
    # stdin is now /dev/null: the episode reads the end of input, a late attach reaches nobody.
    assert os.read(r.stdin.fileno(), 10) == b""


def test_hostile_connections_are_closed_and_the_runner_still_takes_a_good_line(runner, monkeypatch):
    monkeypatch.setattr(episode, "HANDOVER_MAX_BYTES", 4096)
    monkeypatch.setattr(episode, "HANDOVER_READ_SECONDS", 0.5)
    r = runner()
    for hostile in (
        b"wrong\n" + _line(ROLLOUT_BATCH_ID="evil"),  # wrong token
        b"s3cret\n" + _line(ROLLOUT_BATCH_ID="evil")[:-1],  # no end of line
        b"s3cret\nnot json at all\n",
        b"s3cret\n[1, 2]\n",  # JSON, but not a hand-over
        b"s3cret\n" + _line(ROLLOUT_BATCH_ID="x" * 5000),  # too long
        b"s3cret\n" + _line() + b"more\n",  # anything after the line
        b"\xff" * 10_000,  # garbage without a newline, past the cap
    ):
        assert r.send(hostile) == b"", hostile[:40]
    assert r.send(b"s3cret", close_write=False) == b""  # too slow: closed by the runner
    assert r.thread.is_alive() and "ROLLOUT_BATCH_ID" not in r.environ
    assert r.send(b"s3cret\n" + _line(ROLLOUT_BATCH_ID="good")) == b"ok\n"
    assert r.done() is True and r.environ["ROLLOUT_BATCH_ID"] == "good"


def test_stdin_still_hands_over_with_the_port_set_and_closes_the_port(runner):
    r = runner()
    os.write(r.stdin_w, _line(ROLLOUT_BATCH_ID="by-attach"))
    assert r.done() is True and r.environ["ROLLOUT_BATCH_ID"] == "by-attach"
    assert not r.listening()


def test_stdin_closed_without_a_line_means_no_episode_with_the_port_set(runner):
    r = runner()
    os.close(r.stdin_w)
    r.stdin_w = os.open(os.devnull, os.O_WRONLY)  # for close()
    assert r.done() is False and not r.listening()


def test_the_token_leaves_the_process_environment_for_good(monkeypatch, tmp_path):
    """The real os.environ: popped means unset for children too (the agent's processes)."""
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    monkeypatch.setenv(PORT_ENV, "x")  # not a port: plain stdin
    read, write = os.pipe()
    os.write(write, _line())
    os.close(write)
    monkeypatch.setenv("ROLLOUT_ACTION", "")  # set by the line; monkeypatch restores it
    with open(read, encoding="utf-8") as stdin:
        assert episode.wait_for_handover(stdin)
    assert TOKEN_ENV not in os.environ
    child = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ.get({TOKEN_ENV!r}))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == "None"


# -- the worker's side ----------------------------------------------------------------------------


class _FakeRunner:
    """A local TCP server playing the runner: reads token + line, answers `answer` or nothing."""

    def __init__(self, answer: bytes | None, port: int = 0) -> None:
        self.server = socket.create_server(("127.0.0.1", port))
        self.port = self.server.getsockname()[1]
        self.got = b""
        self.answer = answer
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.server.accept()
        with conn, contextlib.suppress(OSError):
            while self.got.count(b"\n") < 2 and (chunk := conn.recv(1 << 16)):
                self.got += chunk
            if self.answer is not None:
                conn.sendall(self.answer)
            else:
                time.sleep(1)

    def target(self) -> handover.Direct:
        return handover.Direct("127.0.0.1", self.port, "tok")

    def close(self) -> None:
        self.thread.join(5)
        self.server.close()


def test_send_sends_token_and_line_and_reads_the_ack(monkeypatch):
    monkeypatch.setattr(handover, "CONNECT_SECONDS", 0.3)
    fake = _FakeRunner(b"ok\n")
    assert handover.send(fake.target(), b'{"env": {}}\n', 5) is handover.Sent.ACKED
    fake.close()
    assert fake.got == b'tok\n{"env": {}}\n'
    silent = _FakeRunner(None)
    assert handover.send(silent.target(), b"{}\n", 0.3) is handover.Sent.UNCONFIRMED
    silent.close()
    wrong = _FakeRunner(b"no\n")
    assert handover.send(wrong.target(), b"{}\n", 5) is handover.Sent.UNCONFIRMED
    wrong.close()
    closed = handover.Direct("127.0.0.1", _free_port(), "tok")
    assert handover.send(closed, b"{}\n", 5) is handover.Sent.UNREACHED


def test_a_runner_that_listens_a_moment_after_its_pod_runs_is_still_reached_directly():
    port = _free_port()
    late: list[_FakeRunner] = []

    def listen_late() -> None:
        time.sleep(0.3)
        late.append(_FakeRunner(b"ok\n", port))

    threading.Thread(target=listen_late, daemon=True).start()
    target = handover.Direct("127.0.0.1", port, "tok")
    assert handover.send(target, b"{}\n", 5) is handover.Sent.ACKED  # refused, then reached
    late[0].close()
    assert late[0].got == b"tok\n{}\n"


@pytest.fixture
def attach(monkeypatch):
    """The attach, stubbed: records the Pods it was asked to hand over."""
    calls: list[tuple[str, bytes]] = []
    monkeypatch.setattr(
        pools, "_attach_and_write", lambda _c, _ns, name, line: calls.append((name, line)) or True
    )
    monkeypatch.setattr(pools, "CONFIRM_SECONDS", 0.3)
    monkeypatch.setattr(handover, "CONNECT_SECONDS", 0.3)
    return calls


def _hand_over(direct: handover.Direct | None, *, log: str = "", mode: str | None = "x") -> Any:
    calls = _Calls(log)
    wp = _pools(calls, mode and "10.89.0.1/32")
    wp.core = type("Core", (_Api,), {"api_client": type("C", (), {"configuration": None})})()
    wp._hand_over(spec(), "ns", Claimed(1, "warm-a", "uid-a", 0.0, direct))
    return calls


def test_an_acked_direct_hand_over_needs_no_attach(attach):
    fake = _FakeRunner(b"ok\n")
    _hand_over(fake.target())
    fake.close()
    assert attach == [] and fake.got == b"tok\n" + warm.handover_line(spec(), 1)


def test_an_unreachable_pod_is_handed_over_by_attach(attach):
    calls = _hand_over(handover.Direct("127.0.0.1", _free_port(), "tok"))
    assert attach == [("warm-a", warm.handover_line(spec(), 1))]
    assert "read_namespaced_pod_log" not in [n for n, _ in calls.made]  # nothing was sent
    assert "delete_namespaced_pod" not in [n for n, _ in calls.made]


def test_a_line_sent_without_an_ack_goes_by_attach_only_if_the_runner_has_no_episode(attach):
    fake = _FakeRunner(None)
    calls = _hand_over(fake.target(), log=f'{{{EVENT_KEY_MARK} "ready"}}\n')
    fake.close()
    assert attach == [] and "read_namespaced_pod_log" in [n for n, _ in calls.made]
    fake = _FakeRunner(None)
    _hand_over(fake.target(), log="")
    fake.close()
    assert attach == [("warm-a", warm.handover_line(spec(), 1))]


def test_attach_only_when_direct_mode_is_off_or_the_pod_has_no_token(attach):
    fake = _FakeRunner(b"ok\n")
    _hand_over(fake.target(), mode=None)  # this worker is not in direct mode
    _hand_over(None)  # a Pod an attach-only worker filled
    assert len(attach) == 2 and fake.got == b""
    socket.create_connection(("127.0.0.1", fake.port)).close()  # lets the fake end
    fake.close()


def test_the_worker_hands_over_to_the_real_runner_directly(runner, attach):
    r = runner()
    _hand_over(handover.Direct("127.0.0.1", r.port, "s3cret"))
    assert r.done() is True and attach == []
    assert r.environ["ROLLOUT_BATCH_ID"] == spec().batch_id


def test_a_waiting_runner_program_takes_its_episode_over_the_port_and_runs_it(tmp_path):
    """The program as it ships, in its own process: stdin stays open (no attach ever comes),
    the line arrives on the port, the demo episode runs to its reward."""
    runner_file = tmp_path / "program" / "episode.py"
    runner_file.parent.mkdir()
    runner_file.write_text(program_text())
    (tmp_path / "ws").mkdir()
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-B", str(runner_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={
            "PATH": os.environ["PATH"],
            "EPISODE_ID": "warm-x",
            "ROLLOUT_HANDOVER": "stdin",
            "ROLLOUT_WORKSPACE": str(tmp_path / "ws"),
            PORT_ENV: str(port),
            TOKEN_ENV: "s3cret",
        },
    )
    try:
        target = handover.Direct("127.0.0.1", port, "s3cret")
        assert handover.send(target, warm.handover_line(spec(action="fix"), 0), 10) is (
            handover.Sent.ACKED
        )
        out, err = proc.communicate(timeout=60)  # closes stdin: the episode has its line
    finally:
        proc.kill()
    events = [json.loads(x) for x in out.decode().splitlines()]
    assert [e["event"] for e in events] == ["ready", "reward"], err.decode()
    assert events[1]["reward"] == 1 and proc.returncode == 0
