"""How a local sandbox (no network) reaches the batch's policy: one unix socket per episode.

The supervisor opens a socket for each episode it starts and bind-mounts it into the sandbox;
the runner speaks HTTP over it. The proxy forwards only POST `/rollout/<this episode>/v1/chat/
completions` (and GET `.../v1/models`) to the batch's policy URL, nothing else: no other
path, no other episode's identity, no other host. It sets the identity headers itself (group,
task, sample, episode, attempt), whatever the sandbox sent, so a trainer can trust them.

What a sandbox sends is hostile input: a body is read only by a single plain Content-Length of
at most MAX_BODY (no chunked body, no length to read until the connection ends: the host's
memory), is forwarded only when whole, and every refusal closes the connection (so an unread
body is never taken for the next request). A connection idle for CLIENT_IDLE_SECONDS is
closed, and an episode holds at most MAX_CONNECTIONS at once (each costs the host a
thread). The proxy counts the chat completions it answered per episode (`answered`): an
agent can call this socket directly, bypassing the runner's recording proxy, so the
runner's own count is not to be trusted alone.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import socketserver
import tempfile
import threading
import urllib.parse
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from rollout_wire.policy import PolicyEndpoint
from rollout_worker.backends.local.files import unix_address

MAX_BODY = 8 * 2**20
# A Content-Length as RFC 9110 spells it: ASCII digits only (int() also takes "+5", "5_0",
# " 5", non-ASCII digits).
_DIGITS = re.compile(r"[0-9]+")
MAX_RESPONSE = 16 * 2**20
# A connection that sends nothing for this long is closed: the runner writes each request as
# soon as it connects (it waits on the policy, not the other way round), and an idle or
# trickling connection would hold one of the host's threads.
CLIENT_IDLE_SECONDS = 30.0
# Connections one episode may hold open at once; beyond, a new one is closed unanswered (a
# sandbox opening sockets without end would otherwise cost the host a thread each). The runner
# holds one at a time.
MAX_CONNECTIONS = 16
# Response headers a sandbox gets from the policy server (the rest stay here).
PASSED_HEADERS = ("X-Policy-Version",)
IDENTITY_HEADERS = {
    "group_id": "X-Rollout-Group-Id",
    "task_id": "X-Rollout-Task-Id",
    "sample": "X-Rollout-Sample",
    "episode_id": "X-Rollout-Episode-Id",
    "attempt": "X-Rollout-Attempt",
}


@dataclass(frozen=True)
class EpisodeIdentity:
    episode_id: str
    group_id: str
    task_id: str
    sample: int
    attempt: int = 0  # 0 first; n for the n-th retry after an infrastructure failure


class _Handler(BaseHTTPRequestHandler):
    server: _EpisodeServer
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_IDLE_SECONDS  # on every read and write of the sandbox's side

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def address_string(self) -> str:
        return "sandbox"

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        extra: dict[str, str] | None = None,
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def _refuse(self, status: int, why: str) -> None:
        self.server.proxy.refused.append(f"{self.command} {self.path[:200]}: {why}")
        # Closed after: what the sandbox sent past the headers is never read as a request.
        self.close_connection = True
        self._send(
            status,
            b'{"error": {"message": "' + why.encode() + b'"}}',
            extra={"Connection": "close"},
        )

    def _length(self, required: bool) -> int | None:
        """The body's length, or None once refused: one Content-Length of decimal digits up to
        MAX_BODY (a missing one is 0 unless `required`); no Transfer-Encoding."""
        if "Transfer-Encoding" in self.headers:
            self._refuse(411, "chunked bodies are not accepted: send a Content-Length")
            return None
        values = self.headers.get_all("Content-Length") or []
        if not values:
            if required:
                self._refuse(411, "a Content-Length is required")
                return None
            return 0
        text = values[0].strip(" \t")
        if len(values) > 1 or not _DIGITS.fullmatch(text):
            self._refuse(400, "Content-Length must be one decimal number")
            return None
        digits = text.lstrip("0") or "0"
        # The digit count first: int() of thousands of digits is slow (or refused).
        if len(digits) > len(str(MAX_BODY)) or int(digits) > MAX_BODY:
            self._refuse(413, f"request body above {MAX_BODY} bytes")
            return None
        return int(digits)

    def _allowed(self) -> bool:
        prefix = f"/rollout/{urllib.parse.quote(self.server.identity.episode_id)}/v1/"
        path = self.path.split("?")[0]
        if not path.startswith(prefix):
            self._refuse(403, "only this episode's policy endpoint may be called")
            return False
        rest = path[len(prefix) :]
        if (self.command, rest) not in (("POST", "chat/completions"), ("GET", "models")):
            self._refuse(404, "only chat/completions and models are forwarded")
            return False
        return True

    def do_GET(self) -> None:
        if not self._allowed():
            return
        length = self._length(required=False)
        if length is None:
            return
        if length:
            self._refuse(400, "a GET takes no body")
            return
        self._forward(None)

    def do_POST(self) -> None:
        if not self._allowed():
            return
        length = self._length(required=True)
        if length is None:
            return
        body = self.rfile.read(length)
        if len(body) < length:  # the sandbox closed early: half a request is not forwarded
            self._refuse(400, "the request body ended before its Content-Length")
            return
        self._forward(body)

    def do_PUT(self) -> None:
        self._refuse(405, "method not allowed")

    do_DELETE = do_PATCH = do_PUT

    def _forward(self, body: bytes | None) -> None:
        proxy = self.server.proxy
        headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
        identity = self.server.identity
        for field, name in IDENTITY_HEADERS.items():
            headers[name] = str(getattr(identity, field))
        policy = proxy.policy
        conn_class = (
            http.client.HTTPSConnection if policy.scheme == "https" else http.client.HTTPConnection
        )
        conn = conn_class(policy.host, policy.port, timeout=proxy.timeout)
        try:
            conn.connect()
            # http.client writes the headers and the body apart: without this the body waits
            # for the server's delayed ACK of the headers (Nagle's algorithm, up to ~40 ms).
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request(self.command, policy.path + self.path, body=body, headers=headers)
            response = conn.getresponse()
            content_type = response.getheader("Content-Type", "application/json")
            # The server's policy version travels on to the runner (it records every turn's).
            extra = {
                name: value
                for name in PASSED_HEADERS
                if (value := response.getheader(name)) is not None
            }
            if content_type.startswith("text/event-stream") and response.status == 200:
                self._answered()
                self._relay_stream(response, content_type, extra)
                return
            data = response.read(MAX_RESPONSE + 1)
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            # 502/504: the runner retries, then reports an infrastructure failure.
            timed_out = "timed out" in str(exc).lower()
            why = f"policy endpoint {'timed out' if timed_out else 'unreachable'}: {exc}"
            self._send(504 if timed_out else 502, json.dumps({"error": {"message": why}}).encode())
            return
        finally:
            conn.close()
        if len(data) > MAX_RESPONSE:
            self._send(502, b'{"error": {"message": "policy response too large"}}')
            return
        if status == 200:
            self._answered()
        self._send(status, data, content_type, extra)

    def _answered(self) -> None:
        if self.command == "POST":  # chat/completions: the only POST `_allowed` lets through
            self.server.proxy.count(self.server)

    def _relay_stream(
        self, response: http.client.HTTPResponse, content_type: str, extra: dict[str, str]
    ) -> None:
        """A streamed answer goes on as it comes (each chunk as soon as it is read), framed by
        the connection's end; at most MAX_RESPONSE bytes of it."""
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        try:
            while sent <= MAX_RESPONSE:
                piece = response.read1(65536)
                if not piece:
                    break
                self.wfile.write(piece)
                self.wfile.flush()
                sent += len(piece)
        except OSError:
            pass  # either side went away: the runner records the stream as cut


class _EpisodeServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, identity: EpisodeIdentity, proxy: PolicyProxy) -> None:
        self.identity = identity
        self.proxy = proxy
        self.answered = 0  # chat completions answered 200 (under the proxy's lock)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.path = Path(path)  # server_bind's: the address as asked, however long
        super().__init__(path, _Handler)

    def server_bind(self) -> None:
        # However deep the folder (a host's warm sandbox's is): the sandbox connects through
        # its own short mount.
        with unix_address(self.path) as address:
            self.socket.bind(address)
        self.server_address = str(self.path)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.proxy.refused.append(
                f"{self.identity.episode_id}: over {MAX_CONNECTIONS} connections"
            )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started: it will not release it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class PolicyProxy:
    """Per-episode sockets forwarding to one policy endpoint (the batch's)."""

    def __init__(self, policy: PolicyEndpoint, timeout: float) -> None:
        self.policy = policy
        self.timeout = timeout
        # Short paths: a unix socket path has at most 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="rollout-policy-"))
        self.dir.chmod(0o755)
        self.servers: dict[int, tuple[_EpisodeServer, threading.Thread, Path]] = {}
        # The last refusals (for debugging); bounded: a sandbox can send refused requests
        # without end.
        self.refused: deque[str] = deque(maxlen=100)
        # Each episode's last server, kept after `close` until `answered` reads its count; a
        # server of its own per opening, so a late answer of an earlier attempt counts there.
        self._counted: dict[int, _EpisodeServer] = {}
        self._lock = threading.Lock()

    def socket_path(self, index: int) -> Path:
        return self.dir / f"{index}.sock"

    def open(self, index: int, identity: EpisodeIdentity, path: Path | None = None) -> Path:
        """Serve episode `index` on a socket at `path` (default: in this proxy's folder; a warm
        sandbox brings a folder of its own that it sees already)."""
        path = path or self.socket_path(index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = _EpisodeServer(str(path), identity, self)
        # The sandbox runs as another user: it must be able to connect.
        os.chmod(path, 0o666)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.servers[index] = (server, thread, path)
        with self._lock:
            self._counted[index] = server
        return path

    def count(self, server: _EpisodeServer) -> None:
        with self._lock:
            server.answered += 1

    def answered(self, index: int) -> int:
        """How many chat completions episode `index`'s socket answered with a 200 since it was
        last opened, whoever asked (0: none, or never opened). Read once: the count is
        forgotten after it is returned."""
        with self._lock:
            server = self._counted.pop(index, None)
            return server.answered if server is not None else 0

    def close(self, index: int, wait: bool = False) -> None:
        """Stop serving episode `index` (in the background: the supervisor's loop never waits
        for a server thread's poll interval)."""
        entry = self.servers.pop(index, None)
        if entry is None:
            return
        server, _, path = entry
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # no new connection from now on

        def stop() -> None:
            server.shutdown()
            server.server_close()

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        if wait:
            stopper.join()

    def close_all(self) -> None:
        for index in list(self.servers):
            self.close(index, wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)
