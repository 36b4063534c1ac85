"""The policy's HTTP client: chat completions with the episode's identity, retries,
kept connections, the version that answered and the staleness rule."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import typing
import urllib.parse

from .cost import LEDGER
from .errors import ConnectTimeout, InfrastructureError, ResponseTooLarge, StalePolicy
from .http1 import Connection, Response, header_lines

# Asked on every turn for the trainer's token view (rollout_wire/tokens.py): the server's own
# prompt and completion ids (vLLM, SGLang) and the sampled tokens' log-probabilities.
TOKEN_REQUEST = {"return_token_ids": True, "logprobs": True}
MAX_RESPONSE_READ = 8 * 2**20
# A connection the policy endpoint has not accepted by then is retried on a new one rather than
# waited on for the whole request timeout (a dropped SYN costs seconds, not a minute; OpenAI's
# own client uses 5 s too).
CONNECT_TIMEOUT_SECONDS = 5.0
# A connection to the policy answered within this long is used again (a new TCP connection
# costs a round trip and the server a new thread: ~2 ms a call on a Pod network); older, it is
# closed, since servers close idle ones (uvicorn, under vLLM and SGLang, after 5 s).
KEEP_ALIVE_SECONDS = 2.0
GROUP_HEADER = "X-Rollout-Group-Id"
VERSION_HEADER = "X-Policy-Version"
# A version is a label, not a payload: a longer one is cut so events stay small.
MAX_VERSION_CHARS = 128
INTEGER = re.compile(r"-?[0-9]+")


def policy_version(header: object, response: object) -> str | None:
    """The version that answered a turn: the response header, else the body's
    `weight_version` (top level, or in `metadata` as SGLang sends it); None if none says."""
    candidates = [header]
    if isinstance(response, dict):
        candidates.append(response.get("weight_version"))
        metadata = response.get("metadata")
        if isinstance(metadata, dict):
            candidates.append(metadata.get("weight_version"))
    for value in candidates:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            continue
        text = str(value).strip()
        if text:
            return text[:MAX_VERSION_CHARS]
    return None


def version_lag(first: str | None, current: str | None) -> int | None:
    """current - first when both are integers; None otherwise (labels are never compared)."""
    if first is None or current is None:
        return None
    if not (INTEGER.fullmatch(first) and INTEGER.fullmatch(current)):
        return None
    return int(current) - int(first)


def staleness(
    first: str | None, version: str | None, bound: int | None, steps: int
) -> StalePolicy | None:
    """The staleness rule, for the built-in loop and the recording proxy alike: a StalePolicy
    (after `steps` recorded turns) when `version` is more than `bound` versions past `first`,
    the version that answered the first turn; None otherwise, or when either is no integer."""
    lag = version_lag(first, version)
    if bound is None or lag is None or lag <= bound:
        return None
    return StalePolicy(str(first), str(version), lag, bound, steps)


class Policy:
    """Chat completions at `<root>/rollout/<episode id>/v1`, with the group id on every call."""

    def __init__(self, config: dict, episode_id: str, identity: dict) -> None:
        self.model = config.get("model", "policy")
        self.sampling = dict(config.get("sampling") or {})
        self.timeout = float(config.get("request_timeout_seconds", 60))
        self.retries = int(config.get("max_retries", 2))
        lag = config.get("max_policy_lag")
        self.max_policy_lag = lag if isinstance(lag, int) and not isinstance(lag, bool) else None
        # What every turn asks for on the trainer's behalf (its token view), unless the batch
        # said `tokens: false`.
        self.token_request = TOKEN_REQUEST if config.get("tokens", True) is not False else {}
        self.socket_path = os.environ.get("ROLLOUT_POLICY_SOCKET")
        self.kept: tuple | None = None  # (connection, when its last answer was read)
        self.kept_lock = threading.Lock()
        root = os.environ.get("ROLLOUT_POLICY_URL", "http://policy")
        parsed = urllib.parse.urlsplit(root)
        self.scheme, self.netloc = parsed.scheme, parsed.netloc.rpartition("@")[2]
        self.host = parsed.hostname or ""
        self.port = parsed.port or (443 if self.scheme == "https" else 80)
        prefix = parsed.path.rstrip("/")
        self.path = f"{prefix}/rollout/{urllib.parse.quote(episode_id)}/v1/chat/completions"
        self.base_url = f"{root.rstrip('/')}/rollout/{episode_id}/v1"
        self.headers = {
            "Content-Type": "application/json",
            GROUP_HEADER: identity["group_id"],
            "X-Rollout-Task-Id": identity["task_id"],
            "X-Rollout-Sample": str(identity["sample"]),
            "X-Rollout-Episode-Id": episode_id,
            "X-Rollout-Attempt": str(identity.get("attempt", 0)),
        }
        self.head_lines: bytes | None = None

    def head(self) -> bytes:
        """The request's header lines but Host and Content-Length, encoded once."""
        if self.head_lines is None:
            fields = [("Accept-Encoding", "identity"), *self.headers.items()]
            self.head_lines = header_lines(fields).encode("latin-1")
        return self.head_lines

    def connect(self) -> Connection:
        """A connection to the endpoint, made within CONNECT_TIMEOUT_SECONDS; its reads then
        wait up to the request timeout."""
        timeout = min(CONNECT_TIMEOUT_SECONDS, self.timeout)
        sock: typing.Any = None
        try:
            if self.socket_path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(self.socket_path)
            else:
                # Each address the name has, in turn (as http.client connects).
                sock = socket.create_connection((self.host, self.port), timeout)
                # A small request waits for the server's delayed ACK of the last under Nagle.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.scheme == "https" and not self.socket_path:
                import ssl  # only an https endpoint pays for it

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self.timeout)
        except socket.timeout:  # noqa: UP041 (Python 3.9: not yet TimeoutError)
            if sock is not None:
                sock.close()
            raise ConnectTimeout(f"no connection within {timeout:g}s") from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        return Connection(sock, "policy" if self.socket_path else self.netloc)

    def reuse(self) -> Connection:
        """The kept connection if it is fresh enough, else a new one (one at a time: the
        recording proxy's threads may ask at once)."""
        with self.kept_lock:
            kept, self.kept = self.kept, None
        if kept is not None:
            if time.monotonic() - kept[1] < KEEP_ALIVE_SECONDS:
                return kept[0]
            kept[0].close()
        return self.connect()

    def keep(self, conn: Connection, response: Response) -> None:
        """Keep a connection whose answer was read whole, unless the server closes it."""
        if response.will_close or not response.complete:
            conn.close()
            return
        with self.kept_lock:
            old, self.kept = self.kept, (conn, time.monotonic())
        if old is not None:
            old[0].close()

    def send(self, payload: bytes, keep_open: bool = False) -> Answer:
        """POST a chat completions body. Retries connection failures, timeouts, 429 and 5xx;
        returns the first other answer, or the last 429/5xx; raises InfrastructureError when
        the endpoint never answered. With `keep_open`, an event stream is returned unread."""
        problem = ""
        began = time.time()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
                LEDGER.retried(time.time() - began)
                began = time.time()
            try:
                # A stream is read by the caller, then closed: never kept.
                conn = self.connect() if keep_open else self.reuse()
            except OSError as exc:
                problem = f"policy endpoint unreachable: {type(exc).__name__}: {exc}"
                continue
            try:
                LEDGER.sent()
                conn.post(self.path, self.head(), payload)
                response = conn.response()
                status = response.status
                header = response.getheader(VERSION_HEADER)
                kind = response.getheader("Content-Type") or ""
                if keep_open and status == 200 and "text/event-stream" in kind:
                    return Answer(status, b"", header, attempt + 1, kind, conn, response)
                raw = response.read(MAX_RESPONSE_READ + 1)
            except OSError as exc:  # WireError (a malformed answer) too
                conn.close()
                failed = "timed out" if isinstance(exc, socket.timeout) else "unreachable"
                problem = f"policy endpoint {failed}: {type(exc).__name__}: {exc}"
                continue
            self.keep(conn, response)
            if (status == 429 or status >= 500) and attempt < self.retries:
                problem = f"policy endpoint answered HTTP {status}: {raw[:200]!r}"
                continue
            return Answer(status, raw, header, attempt + 1, kind)
        LEDGER.retried(time.time() - began)
        raise InfrastructureError(f"{problem} (after {self.retries + 1} attempt(s))")

    def complete(self, messages: list, tools: list) -> tuple[dict, bytes, int, str | None]:
        """(parsed response, raw bytes, attempts, X-Policy-Version header or None) of a turn
        offering `tools`. Raises InfrastructureError when the retries are spent or the answer
        is no chat completion."""
        body = dict(self.sampling)
        body.update(self.token_request)
        body.update({"model": self.model, "messages": messages, "tools": tools})
        answer = self.send(json.dumps(body).encode())
        status, raw = answer.status, answer.raw
        if status == 429 or status >= 500:
            raise InfrastructureError(
                f"policy endpoint answered HTTP {status}: {raw[:200]!r} "
                f"(after {answer.attempts} attempt(s))"
            )
        if status != 200:
            raise InfrastructureError(
                f"policy endpoint refused the request: HTTP {status}: {raw[:200]!r}"
            )
        if len(raw) > MAX_RESPONSE_READ:
            raise ResponseTooLarge(f"policy response exceeds {MAX_RESPONSE_READ} bytes")
        try:
            parsed = json.loads(raw)
            message = parsed["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError("message is not an object")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise InfrastructureError(
                f"policy endpoint sent no chat completion ({exc}): {raw[:200]!r}"
            ) from None
        return parsed, raw, answer.attempts, answer.header


class Answer:
    """What the policy endpoint said: its status, body (none yet for a stream left open, which
    `conn` and `response` still read), version header, content type, and the attempts taken."""

    def __init__(
        self,
        status: int,
        raw: bytes,
        header: str | None,
        attempts: int,
        content_type: str,
        conn: Connection | None = None,
        response: Response | None = None,
    ) -> None:
        self.status = status
        self.raw = raw
        self.header = header
        self.attempts = attempts
        self.content_type = content_type
        self.conn = conn
        self.response = response
