"""The recording proxy's HTTP side: the agent's OpenAI-compatible endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import socketserver
import typing
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .policy import VERSION_HEADER


class Serving(typing.Protocol):
    """What the handler asks of the proxy that serves through it (proxy.Proxy)."""

    policy: typing.Any

    def exchange(self, handler: typing.Any, request: dict) -> None: ...

    def fail(self, message: str) -> None: ...


MAX_AGENT_REQUEST = 32 * 2**20


def error_body(message: str, kind: str) -> dict:
    """An error in the OpenAI API's shape, which clients show as the cause."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def is_completion(value: object) -> bool:
    try:
        return isinstance(value["choices"][0]["message"], dict)  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return False


class ProxyHandler(BaseHTTPRequestHandler):
    """The agent's side: GET .../models answered here, POST .../chat/completions forwarded."""

    protocol_version = "HTTP/1.1"
    server: ProxyServer
    # An answer's headers and body are two writes: with Nagle's algorithm the second waits
    # for the agent's delayed ACK of the first (~40 ms a call on a keep-alive connection).
    disable_nagle_algorithm = True
    gone = False  # the agent hung up: the rest of an answer is read, not written

    def log_message(self, format: str, *args: typing.Any) -> None:
        pass  # stdout and stderr carry events only

    def send_body(
        self, status: int, body: bytes, kind: str = "application/json", version: str | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind or "application/json")
            self.send_header("Content-Length", str(len(body)))
            if version:
                self.send_header(VERSION_HEADER, version)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def send_json(self, status: int, value: object) -> None:
        self.send_body(status, json.dumps(value).encode())

    def start_stream(self, version: str | None) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            if version:
                self.send_header(VERSION_HEADER, version)
            self.end_headers()
        except OSError:
            self.gone = self.close_connection = True

    def send_chunk(self, data: bytes, last: bool = False) -> None:
        if self.gone:
            return
        try:
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            if last:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.gone = self.close_connection = True

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        model = {
            "id": self.server.proxy.policy.model,
            "object": "model",
            "created": 0,
            "owned_by": "rollout",
        }
        if path.endswith("/models"):
            self.send_json(200, {"object": "list", "data": [model]})
        elif "/models/" in path:
            self.send_json(200, model)
        else:
            self.send_json(404, error_body(f"no route {self.path}", "not_found"))

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        length = self.headers.get("Content-Length") or ""
        refused = None
        if not length.isdigit():
            refused = 411, error_body("a Content-Length is required", "invalid_request_error")
        elif not path.endswith("/chat/completions"):
            refused = 404, error_body(f"only chat completions are served, not {path}", "not_found")
        elif int(length) > MAX_AGENT_REQUEST:
            refused = 413, error_body("the request is too large", "invalid_request_error")
        if refused is not None:
            self.close_connection = True  # its body is left unread
            self.send_json(*refused)
            return
        try:
            request = json.loads(self.rfile.read(int(length)))
        except ValueError:
            request = None
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            self.send_json(
                400,
                error_body("the body must be a JSON object with messages", "invalid_request_error"),
            )
            return
        try:
            self.server.proxy.exchange(self, request)
        except Exception as exc:
            # A fault of the runner itself: the episode's record cannot be trusted.
            self.server.proxy.fail(f"the runner's proxy failed: {type(exc).__name__}: {exc}")
            self.close_connection = True


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: Serving) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), ProxyHandler)

    def server_bind(self) -> None:
        # HTTPServer would look up 127.0.0.1's name: the sandbox may have no resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "127.0.0.1", int(self.server_address[1])

    def handle_error(self, request: typing.Any, client_address: typing.Any) -> None:
        pass  # an agent hanging up mid-answer; nothing but events goes to stderr
