"""The runner's own HTTP/1.1 (runner/http1.py): the policy client reads every framing a server
may answer with and takes a malformed or cut answer for a lost connection; the recording proxy
reads an agent's request only by one plain Content-Length, refuses the rest and closes."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.runner_program import episode

COMPLETION = b'{"choices": [{"message": {"role": "assistant", "content": "hi"}}]}'
IDENTITY = {"group_id": "b:t", "task_id": "t", "sample": 0, "attempt": 0}


def read_request(reader) -> tuple[bytes, bytes] | None:
    """(head, body) of one request, read by its Content-Length; None when the client closed."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = reader.readline()
        if not line:
            return None
        head += line
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, reader.read(length)


class Scripted:
    """A policy endpoint that answers each request with the next scripted bytes (closing the
    connection after those marked so), noting which connection each request came on."""

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[int, bytes, bytes]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=self.one, args=(conn, number), daemon=True).start()

    def one(self, conn: socket.socket, number: int) -> None:
        reader = conn.makefile("rb")
        with conn:
            while self.answers:
                request = read_request(reader)
                if request is None:
                    return
                self.requests.append((number, *request))
                data, close = self.answers.pop(0)
                for part in data if isinstance(data, list) else [data]:
                    conn.sendall(part)
                    time.sleep(0.01)  # each part its own read on the client's side
                if close:
                    return


@pytest.fixture
def endpoint(monkeypatch) -> Iterator:
    made: list[Scripted] = []

    def make(*answers: tuple[bytes | list, bool]) -> Scripted:
        found = Scripted(list(answers))
        monkeypatch.setenv("ROLLOUT_POLICY_URL", found.url)
        monkeypatch.delenv("ROLLOUT_POLICY_SOCKET", raising=False)
        made.append(found)
        return found

    yield make
    for found in made:
        found.listener.close()


def policy(retries: int = 0) -> episode.Policy:
    config = {"request_timeout_seconds": 5, "max_retries": retries}
    return episode.Policy(config, "b-0", IDENTITY)


def answer(body: bytes, *head: bytes, status: bytes = b"200 OK") -> bytes:
    lines = [b"HTTP/1.1 " + status, b"Content-Type: application/json", *head]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def test_the_request_carries_the_identity_and_its_length_in_one_head(endpoint):
    server = endpoint((answer(COMPLETION, b"Content-Length: %d" % len(COMPLETION)), False))
    _, raw, attempts, _ = policy().complete([{"role": "user", "content": "x"}], [])
    assert raw == COMPLETION and attempts == 1
    (_, head, body) = server.requests[0]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /rollout/b-0/v1/chat/completions HTTP/1.1"
    assert f"Content-Length: {len(body)}" in lines and "X-Rollout-Group-Id: b:t" in lines
    assert json.loads(body)["messages"] == [{"role": "user", "content": "x"}]


def test_a_chunked_answer_with_extensions_and_a_trailer_is_read_whole_and_kept(endpoint):
    chunked = [
        answer(b"", b"Transfer-Encoding: chunked"),
        b"%x;ext=1\r\n%s\r\n" % (10, COMPLETION[:10]),
        b"%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (len(COMPLETION) - 10, COMPLETION[10:]),
    ]
    server = endpoint((chunked, False), (answer(b"{}", b"Content-Length: 2"), False))
    runner = policy()
    assert runner.send(b"{}").raw == COMPLETION
    assert runner.send(b"{}").raw == b"{}"
    assert [number for number, _, _ in server.requests] == [1, 1]  # the connection was kept


def test_an_answer_read_to_the_connections_end_is_whole_and_never_reused(endpoint):
    server = endpoint((answer(COMPLETION), True), (answer(b"{}", b"Content-Length: 2"), False))
    runner = policy()
    assert runner.send(b"{}").raw == COMPLETION
    assert runner.send(b"{}").raw == b"{}"
    assert [number for number, _, _ in server.requests] == [1, 2]


def test_an_http_1_0_answer_closes_unless_it_says_keep_alive(endpoint):
    old = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n"
    server = endpoint(
        (old + b"Connection: keep-alive\r\n\r\n{}", False),
        (old + b"\r\n{}", False),
        (answer(b"{}", b"Content-Length: 2"), False),
    )
    runner = policy()
    assert [runner.send(b"{}").raw for _ in range(3)] == [b"{}"] * 3
    assert [number for number, _, _ in server.requests] == [1, 1, 2]


def test_an_interim_answer_is_skipped(endpoint):
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    endpoint((interim + answer(COMPLETION, b"Content-Length: %d" % len(COMPLETION)), False))
    found = policy().send(b"{}")
    assert (found.status, found.raw) == (200, COMPLETION)


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}", "closed inside"),  # cut short
        (b"ICY 200 OK\r\nContent-Length: 2\r\n\r\n{}", "malformed status line"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}", "malformed status line"),
        ("HTTP/1.1 2²0 OK\r\nContent-Length: 2\r\n\r\n{}".encode("latin-1"), "status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n{}", "malformed Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\n{}", "malformed Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\n{}", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\n folded\r\nContent-Length: 2\r\n\r\n{}", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX", "CRLF"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n", "more than 100 header"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n", "too long"),
        (b"", "closed before an answer"),
    ],
)
def test_a_malformed_or_cut_answer_is_a_lost_connection_never_a_short_body(endpoint, reply, why):
    endpoint((reply, True))
    with pytest.raises(episode.InfrastructureError) as lost:
        policy().send(b"{}")
    assert "unreachable: WireError" in str(lost.value) and why in str(lost.value)


def test_a_lost_answer_is_retried_on_a_new_connection(endpoint, monkeypatch):
    monkeypatch.setattr(episode.time, "sleep", lambda seconds: None)
    server = endpoint(
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}", True),
        (answer(b"{}", b"Content-Length: 2"), False),
    )
    found = policy(retries=1).send(b"{}")
    assert (found.raw, found.attempts) == (b"{}", 2)
    assert [number for number, _, _ in server.requests] == [1, 2]


@pytest.mark.parametrize("framing", [b"Content-Length: 40", b"Transfer-Encoding: chunked"])
def test_an_answer_past_the_size_limit_is_cut_there_and_its_connection_closed(
    endpoint, monkeypatch, framing
):
    monkeypatch.setattr(episode, "MAX_RESPONSE_READ", 16)
    body = b"x" * 40
    if framing.startswith(b"Transfer"):
        body = b"28\r\n" + body + b"\r\n0\r\n\r\n"
    server = endpoint((answer(body, framing), False), (answer(body, framing), False))
    runner = policy()
    assert runner.send(b"{}").raw == b"x" * 17  # the limit and one byte: too large
    with pytest.raises(episode.ResponseTooLarge):
        runner.complete([], [])
    assert [number for number, _, _ in server.requests] == [1, 2]


def test_an_identity_that_would_split_the_head_is_refused(endpoint):
    endpoint((answer(b"{}", b"Content-Length: 2"), False))
    runner = episode.Policy({}, "b-0", dict(IDENTITY, task_id="t\r\nX-Evil: 1"))
    with pytest.raises(ValueError, match="invalid header"):
        runner.send(b"{}")


# -- the recording proxy's side ------------------------------------------------------------------
@pytest.fixture
def proxy(monkeypatch) -> Iterator:
    monkeypatch.setenv("ROLLOUT_POLICY_URL", "http://127.0.0.1:9")
    found = episode.Proxy(episode.Policy({"model": "m"}, "b-0", IDENTITY), IDENTITY).start()
    yield found
    found.close()
    assert found.steps == 0 and found.failure is None


def exchange(proxy, data: bytes, answers: int = 1) -> tuple[list[bytes], bool]:
    """The status lines of what the proxy answered `data` with (until it closed, or up to
    `answers` final ones), and whether it closed."""
    with socket.create_connection(("127.0.0.1", proxy.server.server_address[1]), 5) as conn:
        conn.sendall(data)
        reader = conn.makefile("rb")
        statuses = []
        while True:
            line = reader.readline()
            if not line:
                return statuses, True
            statuses.append(line.rstrip())
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
            if sum(not s.startswith(b"HTTP/1.1 1") for s in statuses) == answers:
                conn.settimeout(0.5)
                try:
                    return statuses, reader.read(1) == b""
                except TimeoutError:
                    return statuses, False


POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"", b"411"),
        (b"Content-Length: -5\r\n", b"411"),
        (b"Content-Length: 2, 2\r\n", b"411"),
        (b"Content-Length: +2\r\n", b"411"),
        (b"Content-Length: 2\r\nContent-Length: 2\r\n", b"411"),
        (b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n", b"411"),
        (b"Content-Length: %d\r\n" % (32 * 2**20 + 1), b"413"),
        (b"Content-Length: 99999999999999999999999\r\n", b"413"),
        ("Content-Length: ²\r\n".encode("latin-1"), b"411"),
        (b"Content-Length : 2\r\n", b"400"),
        (b" folded\r\n", b"400"),
    ],
)
def test_a_request_without_one_plain_content_length_is_refused_and_closed(proxy, head, status):
    # No body: one the proxy leaves unread would reset the connection before its answer.
    statuses, closed = exchange(proxy, POST + head + b"\r\n")
    assert [s.split(b" ")[1] for s in statuses] == [status] and closed


@pytest.mark.parametrize(
    ("line", "status"),
    [
        (b"POST /v1/chat/completions\r\n", b"400"),
        (b"POST /v1/chat/completions HTTP/2.0\r\n", b"505"),
        (b"PUT /v1/chat/completions HTTP/1.1\r\n", b"501"),
    ],
)
def test_a_request_line_not_served_is_refused_and_closed(proxy, line, status):
    statuses, closed = exchange(proxy, line + b"Content-Length: 0\r\n\r\n")
    assert [s.split(b" ")[1] for s in statuses] == [status] and closed


def test_requests_share_a_connection_and_an_expected_continue_is_sent(proxy):
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    waiting = POST + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n{}"
    statuses, closed = exchange(proxy, models + waiting + models, answers=3)
    assert statuses == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 100 Continue",
        b"HTTP/1.1 400 Bad Request",  # {} has no messages
        b"HTTP/1.1 200 OK",
    ]
    assert not closed


def test_an_http_1_0_request_is_answered_then_closed(proxy):
    statuses, closed = exchange(proxy, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert statuses == [b"HTTP/1.1 200 OK"] and closed
