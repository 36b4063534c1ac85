"""The runner's policy connection: answered calls close together reuse one connection (a new
one costs a round trip and the server a thread per call), older ones never do (servers close
idle connections), and a connection the server closes is never reused."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.runner_program import episode


class Server:
    def __init__(self) -> None:
        self.peers: list[int] = []  # the client port of every request
        self.close_after = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                server.peers.append(self.client_address[1])
                body = b'{"choices": [{"message": {"role": "assistant", "content": "hi"}}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if server.close_after:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture
def server(monkeypatch) -> Iterator[Server]:
    found = Server()
    monkeypatch.setenv("ROLLOUT_POLICY_URL", found.url)
    monkeypatch.delenv("ROLLOUT_POLICY_SOCKET", raising=False)
    yield found
    found.http.shutdown()


def policy() -> episode.Policy:
    identity = {"group_id": "b:t", "task_id": "t", "sample": 0, "attempt": 0}
    return episode.Policy({"request_timeout_seconds": 5}, "b-0", identity)


def test_calls_close_together_share_one_connection(server):
    runner = policy()
    for _ in range(3):
        assert runner.send(b"{}").status == 200
    assert len(server.peers) == 3 and len(set(server.peers)) == 1


def test_an_idle_or_closed_connection_is_never_reused(server, monkeypatch):
    monkeypatch.setattr(episode, "KEEP_ALIVE_SECONDS", 0.0)
    runner = policy()
    for _ in range(2):
        assert runner.send(b"{}").status == 200
    server.close_after = True
    monkeypatch.setattr(episode, "KEEP_ALIVE_SECONDS", 60.0)
    for _ in range(2):
        assert runner.send(b"{}").status == 200
    first, second, third, fourth = server.peers
    assert first != second  # kept for no time at all: a new connection
    assert third == second  # kept (the second answer left it open)
    assert fourth != third  # the third answer said Connection: close
