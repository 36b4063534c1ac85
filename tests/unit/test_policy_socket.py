"""The per-episode policy socket of the local backend (backends/local/policy_proxy.py) as a
sandbox may use it: raw bytes over the unix socket, a stdlib HTTP server as the policy.

Issue 43: a request framed so that the host would buffer without bound, or forward a body cut
short, is answered 4xx and the connection closed, and the policy never sees it; the host counts
the completions it answered itself (an agent can bypass the runner's recording proxy)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rollout_wire.policy import PolicyEndpoint
from rollout_worker.backends.local import policy_proxy
from rollout_worker.backends.local.policy_proxy import MAX_BODY, EpisodeIdentity, PolicyProxy

EPISODE = "b1-0"
COMPLETIONS = f"/rollout/{EPISODE}/v1/chat/completions"
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


class Policy:
    """A policy server on 127.0.0.1 that records every request it got."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, bytes]] = []
        self.status = 200
        policy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                policy.requests.append(("GET", self.path, b""))
                self.answer(policy.status, b'{"data": []}', "application/json")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                policy.requests.append(("POST", self.path, body))
                if b'"stream": true' in body:
                    self.answer(200, b"data: {}\n\ndata: [DONE]\n\n", "text/event-stream")
                else:
                    self.answer(policy.status, b'{"choices": []}', "application/json")

            def answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def policy() -> Iterator[Policy]:
    server = Policy()
    yield server
    server.stop()


@pytest.fixture
def proxy(policy: Policy) -> Iterator[PolicyProxy]:
    proxy = PolicyProxy(PolicyEndpoint(url=policy.url), timeout=5)
    proxy.open(0, EpisodeIdentity(episode_id=EPISODE, group_id="g", task_id="t", sample=0))
    yield proxy
    proxy.close_all()


def exchange(proxy: PolicyProxy, raw: bytes, *, end_write: bool = False) -> bytes:
    """Send `raw` over episode 0's socket; everything answered until the proxy closes (a
    socket timeout fails the test: the proxy kept the connection, waiting for more)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(str(proxy.socket_path(0)))
        conn.sendall(raw)
        if end_write:
            conn.shutdown(socket.SHUT_WR)
        answer = b""
        while piece := conn.recv(65536):
            answer += piece
        return answer


def post(headers: str, body: bytes = b"") -> bytes:
    return f"POST {COMPLETIONS} HTTP/1.1\r\nHost: policy\r\n{headers}\r\n".encode() + body


N = len(BODY)
BAD_LENGTHS = {
    "minus-one": ("Content-Length: -1\r\n", BODY, 400),
    "letters": ("Content-Length: abc\r\n", BODY, 400),
    "plus-sign": (f"Content-Length: +{N}\r\n", BODY, 400),  # int() would take these three
    "underscore": (f"Content-Length: {N // 10}_{N % 10}\r\n", BODY, 400),
    "fullwidth": ("Content-Length: \uff16\uff13\r\n", BODY, 400),
    "hex": (f"Content-Length: {N:#x}\r\n", BODY, 400),
    "twice": (f"Content-Length: {N}\r\nContent-Length: {N}\r\n", BODY, 400),
    "missing": ("", BODY, 411),
    "chunked": (
        "Transfer-Encoding: chunked\r\n",
        f"{N:x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n",
        411,
    ),
    "chunked-and-length": (f"Transfer-Encoding: chunked\r\nContent-Length: {N}\r\n", BODY, 411),
    "above-max": (f"Content-Length: {MAX_BODY + 1}\r\n", BODY, 413),
    "5000-digits": (f"Content-Length: {'9' * 5000}\r\n", BODY, 413),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("headers", "body", "status"), BAD_LENGTHS.values(), ids=BAD_LENGTHS)
def test_a_bad_length_is_answered_4xx_the_connection_closed_and_nothing_forwarded(
    proxy, policy, headers, body, status
):
    # The connection stays open on the sandbox's side: only the proxy can end the exchange.
    answer = exchange(proxy, post(headers, body))
    assert answer.startswith(f"HTTP/1.1 {status} ".encode())
    assert b"\r\nConnection: close\r\n" in answer
    assert policy.requests == []
    assert proxy.answered(0) == 0


@pytest.mark.timeout(30)
def test_a_body_cut_short_is_not_forwarded(proxy, policy):
    answer = exchange(proxy, post(f"Content-Length: {len(BODY) + 10}\r\n", BODY), end_write=True)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert policy.requests == []


@pytest.mark.timeout(30)
def test_the_host_counts_the_completions_it_answered_until_the_count_is_read(proxy, policy):
    good = post(f"Content-Length: {len(BODY)}\r\n", BODY)
    # Two completions on one kept-alive connection.
    answer = exchange(proxy, good + good, end_write=True)
    assert answer.count(b"HTTP/1.1 200 ") == 2
    streamed = BODY.replace(b'"model"', b'"stream": true, "model"')
    assert exchange(proxy, post(f"Content-Length: {len(streamed)}\r\n", streamed)).startswith(
        b"HTTP/1.1 200 "
    )
    # Not completions answered: the model list, a refused path, an error of the policy.
    models = f"GET /rollout/{EPISODE}/v1/models HTTP/1.1\r\nHost: p\r\n\r\n".encode()
    assert exchange(proxy, models, end_write=True).startswith(b"HTTP/1.1 200 ")
    other = b"POST /rollout/b1-9/v1/chat/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
    assert exchange(proxy, other).startswith(b"HTTP/1.1 403 ")
    policy.status = 500
    assert exchange(proxy, good, end_write=True).startswith(b"HTTP/1.1 500 ")
    assert [path for _, path, _ in policy.requests].count(COMPLETIONS) == 4
    assert json.loads(policy.requests[0][2]) == json.loads(BODY)

    proxy.close(0, wait=True)
    assert proxy.answered(0) == 3  # kept after the socket closed, until read
    assert proxy.answered(0) == 0
    assert proxy.answered(7) == 0  # never opened


def test_the_count_travels_in_the_status_the_episode_observation_is_read_from():
    from rollout_worker.observation import EpisodeObservation

    status = {"index": 0, "episode_id": EPISODE, "phase": "Succeeded", "policy_completions": 3}
    assert EpisodeObservation.from_dict(status).policy_completions == 3
    assert EpisodeObservation(0, EPISODE, "Running").policy_completions is None  # not counted


def connected(proxy: PolicyProxy) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    for _ in range(100):
        try:
            conn.connect(str(proxy.socket_path(0)))
            return conn
        except BlockingIOError:  # the listen backlog is full until the server accepts
            time.sleep(0.02)
    raise AssertionError("the proxy never accepted the connection")


@pytest.mark.timeout(30)
def test_an_episode_holding_its_connection_cap_gets_the_next_one_closed_unanswered(proxy, policy):
    held = [connected(proxy) for _ in range(policy_proxy.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # every held connection has its thread
        extra = connected(proxy)
        try:
            extra.sendall(post(f"Content-Length: {N}\r\n", BODY))
            answer = extra.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            answer = b""  # closed before (or while) the request was written
        assert answer == b""  # closed, nothing answered
        extra.close()
        assert policy.requests == []
        assert any("over 16 connections" in why for why in proxy.refused)
    finally:
        for conn in held:
            conn.close()
    # Closed connections give their slots back: a request is served again.
    deadline = time.monotonic() + 5
    while True:
        answer = exchange(proxy, post(f"Content-Length: {N}\r\nConnection: close\r\n", BODY))
        if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


@pytest.mark.timeout(30)
def test_a_connection_that_sends_nothing_is_closed_after_the_idle_limit(proxy, monkeypatch):
    monkeypatch.setattr(policy_proxy._Handler, "timeout", 0.3)
    with connected(proxy) as conn:
        conn.sendall(b"POST /rollout/")  # half a request line, then silence
        started = time.monotonic()
        assert conn.recv(65536) == b""
        assert time.monotonic() - started < 4


@pytest.mark.timeout(30)
def test_a_socket_in_a_folder_too_deep_for_sun_path_is_served(policy, tmp_path):
    # A host's warm sandbox folder (root/runs/<batch>/warm/<name>/io) easily passes the 107
    # bytes a unix socket address holds; the sandbox reaches it through its own short mount.
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 5)
    deep.mkdir(parents=True)
    path = deep / "policy.sock"
    assert len(str(path)) >= 108  # sun_path: 107 bytes and its NUL
    proxy = PolicyProxy(PolicyEndpoint(url=policy.url), timeout=5)
    try:
        assert proxy.open(0, EpisodeIdentity(EPISODE, "g", "t", 0), path=path) == path
        assert path.is_socket()
        short = tmp_path / "io"
        short.symlink_to(deep)  # as the sandbox's /sandbox/io mount
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(str(short / "policy.sock"))
            conn.sendall(post(f"Content-Length: {len(BODY)}\r\nConnection: close\r\n", BODY))
            answer = b""
            while piece := conn.recv(65536):
                answer += piece
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert [(m, p) for m, p, _ in policy.requests] == [("POST", COMPLETIONS)]
    finally:
        proxy.close_all()
    assert not path.exists()
