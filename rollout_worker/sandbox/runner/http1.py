"""A small strict HTTP/1.1 for the policy's client and the recording proxy's server: message
heads read with plain string splits, each request or answer written with one send.

http.client and http.server parse every head with the email package and write a head and its
body apart: per policy call through the proxy that was two email parses and four sends, most of
the proxy's CPU, which on Kubernetes shares the sandbox's CPU quota with the agent. Not
importing them (nor email) also saves every episode's runner their import."""

from __future__ import annotations

import io
import socket
import typing

# As http.client's limits: a longer line, or more header lines, is no HTTP we answer or read.
MAX_HEAD_LINE = 65536
MAX_HEAD_FIELDS = 100
TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")


class WireError(OSError):
    """A peer broke HTTP/1.1 (a malformed head, a cut body): handled as a lost connection."""


def read_head(rfile: io.BufferedIOBase) -> tuple[str, dict[str, str]] | None:
    """(the start line, the header fields by lowercase name) of the next message head; None at
    the end of the stream before any byte. A field sent more than once has its values joined by
    ", " (so a repeated Content-Length is no number)."""
    line = rfile.readline(MAX_HEAD_LINE + 1)
    if not line:
        return None
    fields: dict[str, str] = {}
    start = _head_line(line)
    for _ in range(MAX_HEAD_FIELDS + 1):
        text = _head_line(rfile.readline(MAX_HEAD_LINE + 1))
        if not text:
            return start, fields
        name, colon, value = text.partition(":")
        name = name.lower()
        if not colon or not name or not TOKEN_CHARS.issuperset(name):
            # No obsolete line folding, no space before the colon: a request smuggler's tools.
            raise WireError(f"malformed header line {text[:80]!r}")
        value = value.strip(" \t")
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    raise WireError(f"more than {MAX_HEAD_FIELDS} header lines")


def _head_line(line: bytes) -> str:
    if len(line) > MAX_HEAD_LINE:
        raise WireError("a header line is too long")
    if not line.endswith(b"\n"):
        raise WireError("the connection ended inside a message head")
    text = line.decode("latin-1").rstrip("\r\n")
    if "\r" in text or "\0" in text:
        raise WireError("a stray CR or NUL in a message head")
    return text


def tokens(value: str | None) -> set[str]:
    """A comma-separated header's tokens, lowercase (Connection, Transfer-Encoding)."""
    return {part.strip(" \t").lower() for part in (value or "").split(",")}


def ends_connection(version: str, fields: dict[str, str]) -> bool:
    """Whether a message closes its connection after it: "Connection: close", or HTTP/1.0
    without "keep-alive" (both sides of the proxy go by the same rule)."""
    connection = tokens(fields.get("connection"))
    return "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)


def header_lines(fields: typing.Iterable[tuple[str, str]]) -> str:
    """Header lines, each ending in CRLF; ValueError for one that would split the head (as
    http.client refuses it)."""
    lines = []
    for name, value in fields:
        text = f"{name}: {value}\r\n"
        if "\r" in text[:-2] or "\n" in text[:-2] or "\0" in text:
            raise ValueError(f"invalid header {name!r}: {value!r}")
        lines.append(text)
    return "".join(lines)


class Response:
    """An answer's status and head, its body read through `read` (whole, up to a limit) or
    `read1` (as it arrives); framed by chunked encoding, Content-Length or the connection's
    end. `complete` once the body was read to its end."""

    def __init__(self, rfile: io.BufferedIOBase) -> None:
        self.rfile = rfile
        while True:
            head = read_head(rfile)
            if head is None:
                raise WireError("the connection closed before an answer")
            start, self.fields = head
            version, _, rest = start.partition(" ")
            code = rest[:3]
            digits = code.isascii() and code.isdigit()  # not "²": str.isdigit takes it
            if version not in ("HTTP/1.1", "HTTP/1.0") or not digits or rest[3:4].strip():
                raise WireError(f"malformed status line {start[:80]!r}")
            self.status = int(code)
            # Interim answers (100 Continue, 103 Early Hints) come before the real one.
            if not 100 <= self.status < 200 or self.status == 101:
                break
        self.will_close = ends_connection(version, self.fields)
        bodiless = self.status in (204, 304)
        self.chunked = not bodiless and "chunked" in tokens(self.fields.get("transfer-encoding"))
        self.left: int | None = None  # body bytes (of the current chunk, when chunked) unread
        self.complete = False
        length = self.fields.get("content-length")
        if bodiless:
            self.left = 0
        elif self.chunked:
            self.left = 0  # the first chunk's size line is read with the body
        elif length is not None:
            if not length.isdigit() or not length.isascii() or len(length) > 18:
                raise WireError(f"malformed Content-Length {length[:40]!r}")
            self.left = int(length)
        else:
            self.will_close = True  # the body ends with the connection
        self.complete = self.left == 0 and not self.chunked

    def getheader(self, name: str) -> str | None:
        return self.fields.get(name.lower())

    def read(self, limit: int) -> bytes:
        """The body, at most `limit` bytes of it (the rest left unread: `complete` says)."""
        parts: list[bytes] = []
        size = 0
        while size < limit:
            data = self.read1(limit - size)
            if not data:
                break
            parts.append(data)
            size += len(data)
        return b"".join(parts)

    def read1(self, most: int) -> bytes:
        """Some of the body as it arrives, at most `most` bytes; b"" at its end."""
        if self.complete or most <= 0:
            return b""
        if self.chunked and not self.left:
            self._next_chunk()
            if self.complete:
                return b""
        want = most if self.left is None else min(most, self.left)
        data = self.rfile.read1(want)
        if not data:
            if self.left is None:
                self.complete = True  # the connection's end is the body's end
                return b""
            raise WireError("the connection closed inside an answer's body")
        if self.left is not None:
            self.left -= len(data)
            if not self.left and not self.chunked:
                self.complete = True
            elif not self.left and self.rfile.read(2) != b"\r\n":
                raise WireError("a chunk does not end with CRLF")
        return data

    def _next_chunk(self) -> None:
        line = _head_line(self.rfile.readline(MAX_HEAD_LINE + 1))
        size = line.partition(";")[0].strip(" \t")
        if not size or len(size) > 15 or not all(c in "0123456789abcdefABCDEF" for c in size):
            raise WireError(f"malformed chunk size {line[:40]!r}")
        self.left = int(size, 16)
        if self.left:
            return
        for _ in range(MAX_HEAD_FIELDS + 1):  # the trailer: skipped, up to its empty line
            if not _head_line(self.rfile.readline(MAX_HEAD_LINE + 1)):
                self.complete = True
                return
        raise WireError(f"more than {MAX_HEAD_FIELDS} trailer lines")


class Connection:
    """One connection to the policy: `post` writes a request, `response` reads its answer."""

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock = sock
        self.host = host
        self.rfile = sock.makefile("rb")

    def post(self, path: str, head: bytes, body: bytes) -> None:
        """POST `body` to `path`; `head` holds the other header lines, each ending in CRLF."""
        start = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        self.sock.sendall(b"%s%s\r\n%s" % (start.encode("latin-1"), head, body))

    def response(self) -> Response:
        return Response(self.rfile)

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()
