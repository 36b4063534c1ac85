"""The recording proxy's HTTP side: the agent's OpenAI-compatible endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import socketserver
import typing
import urllib.parse

from .http1 import WireError, ends_connection, header_lines, read_head, tokens
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


# The reason phrases the proxy sends itself (a status relayed from the policy gets "Status":
# clients read the code, and the phrase table would cost the http package's import).
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    501: "Not Implemented",
    502: "Bad Gateway",
    505: "HTTP Version Not Supported",
}


class ProxyHandler(socketserver.StreamRequestHandler):
    """The agent's side: GET .../models answered here, POST .../chat/completions forwarded.
    One request at a time per connection, kept open as HTTP/1.1 says; a request is read by a
    single Content-Length, and a malformed one ends the connection after its answer."""

    server: ProxyServer
    # An answer is one write, but a small one still waits for the agent's delayed ACK of the
    # last one under Nagle's algorithm (~40 ms a call on a keep-alive connection).
    disable_nagle_algorithm = True
    gone = False  # the agent hung up: the rest of an answer is read, not written
    close_connection = False
    path = ""

    def handle(self) -> None:
        while not self.close_connection:
            self.handle_one()

    def handle_one(self) -> None:
        try:
            head = read_head(self.rfile)
        except WireError as exc:
            self.close_connection = True
            self.send_json(400, error_body(str(exc), "invalid_request_error"))
            return
        except OSError:
            head = None
        if head is None:
            self.close_connection = True  # the agent closed it (or the line broke)
            return
        line, self.fields = head
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.close_connection = True
            self.send_json(400, error_body(f"bad request line {line[:80]!r}", "bad_request"))
            return
        method, self.path, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            self.close_connection = True
            self.send_json(505, error_body(f"{version[:20]!r} is not served", "bad_request"))
            return
        if ends_connection(version, self.fields):
            self.close_connection = True
        self.version = version
        if method == "GET":
            self.do_GET()
        elif method == "POST":
            self.do_POST()
        else:
            self.close_connection = True
            self.send_json(501, error_body(f"{method[:20]!r} is not served", "bad_request"))

    def head_bytes(self, status: int, fields: list) -> bytes:
        if self.close_connection:
            fields.append(("Connection", "close"))
        reason = REASONS.get(status, "Status")
        return f"HTTP/1.1 {status} {reason}\r\n{header_lines(fields)}\r\n".encode("latin-1")

    def send_body(
        self, status: int, body: bytes, kind: str = "application/json", version: str | None = None
    ) -> None:
        fields = [("Content-Type", kind or "application/json"), ("Content-Length", str(len(body)))]
        if version:
            fields.append((VERSION_HEADER, version))
        try:
            self.wfile.write(self.head_bytes(status, fields) + body)
        except (OSError, ValueError):
            self.close_connection = True

    def send_json(self, status: int, value: object) -> None:
        self.send_body(status, json.dumps(value).encode())

    def start_stream(self, version: str | None) -> None:
        fields = [
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-cache"),
            ("Transfer-Encoding", "chunked"),
        ]
        if version:
            fields.append((VERSION_HEADER, version))
        try:
            self.wfile.write(self.head_bytes(200, fields))
        except (OSError, ValueError):
            self.gone = self.close_connection = True

    def send_chunk(self, data: bytes, last: bool = False) -> None:
        if self.gone:
            return
        try:
            if data or last:
                self.wfile.write(
                    (b"%x\r\n%s\r\n" % (len(data), data) if data else b"")
                    + (b"0\r\n\r\n" if last else b"")
                )
        except OSError:
            self.gone = self.close_connection = True

    def do_GET(self) -> None:
        if "transfer-encoding" in self.fields or self.fields.get("content-length", "0") != "0":
            self.close_connection = True  # a body is never read: it must not pass for a request
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
        length = self.fields.get("content-length") or ""
        refused = None
        if "transfer-encoding" in self.fields or not (length.isdigit() and length.isascii()):
            refused = 411, error_body("a Content-Length is required", "invalid_request_error")
        elif not path.endswith("/chat/completions"):
            refused = 404, error_body(f"only chat completions are served, not {path}", "not_found")
        elif len(length) > 12 or int(length) > MAX_AGENT_REQUEST:
            refused = 413, error_body("the request is too large", "invalid_request_error")
        if refused is not None:
            self.close_connection = True  # its body is left unread
            self.send_json(*refused)
            return
        if "100-continue" in tokens(self.fields.get("expect")) and self.version == "HTTP/1.1":
            try:  # what curl asks before a body above 1 KiB (it waits a second otherwise)
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                self.close_connection = True
                return
        data = self.rfile.read(int(length))
        if len(data) < int(length):
            self.close_connection = True  # the agent hung up inside its request
            return
        try:
            request = json.loads(data)
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


class ProxyServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, proxy: Serving) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), ProxyHandler)

    def handle_error(self, request: typing.Any, client_address: typing.Any) -> None:
        pass  # an agent hanging up mid-answer; nothing but events goes to stderr
