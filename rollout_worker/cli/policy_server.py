"""A small deterministic policy: an OpenAI-compatible chat completions server, scripted per task.

What the suite and the demo use instead of a model (no GPU): each task of the bundled set has
plans, lists of turns; sample n of a task follows plan n % len(plans), and the turn is the
number of assistant messages already in the conversation (the server keeps no state, so a
retried request gets the same answer). A turn is a tool call (`write_file`, `read_file`, `run`,
`submit`), a malformed reply (`text`: no tool call), a slow reply (`delay` seconds before it)
or no reply in time (`hang`: only when the server was started with `hangs=True`, `--hangs`;
otherwise a hang turn submits, so a quick start never waits out policy timeouts). A turn with
`unavailable_on_attempts` (a list of attempt numbers, from `X-Rollout-Attempt`) answers HTTP
503 to those attempts of the episode and acts normally for the others: an infrastructure
failure that a retry in a fresh sandbox gets past. Past its plan, or for a task it does not
know, it submits.

A latency tail, for scheduling experiments: every answered turn waits `turn_seconds` first,
and a fixed fraction (`slow_fraction`) of samples is slow, each of its turns waiting
`turn_seconds * slow_factor`. Which samples are slow is a stable hash of (group id, sample),
so another batch picks other samples and a retried request waits the same.

A policy version (an integer, `version`): every completion carries it in the
`X-Policy-Version` response header and in the body as `metadata.weight_version` (a string).
That is where SGLang's OpenAI-compatible server puts its weight version (non-streaming
responses, "default" until an update names one); vLLM keeps a weight version on its engine
(`finish_weight_update`, `/weight_info`) but its chat completions do not carry it. `POST
/version` with `{"version": n}` sets it, with an empty body adds one; it answers `{"version":
n}` (also GET). `PolicyServer.set_version` / `bump_version` do the same in process.

The task comes from the `X-Rollout-Task-Id` header (else the group id's tail, `<batch>:<task>`),
the sample from `X-Rollout-Sample`. Routes: POST `/rollout/<episode id>/v1/chat/completions`
(the per-episode base URL trainers use) and `/v1/chat/completions`; GET `/v1/models`; GET
`/calls` lists what it was asked (episode, group, task, sample, turn, whether the sample is
slow, the version it answered with), for tests.

Responses look like vLLM's: `logprobs` when the request asks for them, `prompt_token_ids` and
per-choice `token_ids` when it sets `return_token_ids`, from the byte-level tokenizer and chat
template of rollout_wire/byte_template.py, which behave like a real engine's: a conversation
that carries each answer back unchanged is append-only, one that rewrites its context breaks
the prefix, as on vLLM. Every answer carries `usage`: prompt_tokens and completion_tokens
count those ids. A stream sends it as its last chunk when the request asks
(stream_options.include_usage), as OpenAI's API does.

    rollout policy-server --port 8000                 # the bundled set's script
    rollout policy-server --port 8000 --script my.json
    rollout policy-server --hangs --turn-seconds 0.5 --slow-fraction 0.1 --policy-version 3
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import orjson

from rollout_wire.byte_template import END, render_prompt, text_ids

GROUP_HEADER = "X-Rollout-Group-Id"
TASK_HEADER = "X-Rollout-Task-Id"
SAMPLE_HEADER = "X-Rollout-Sample"
EPISODE_HEADER = "X-Rollout-Episode-Id"
ATTEMPT_HEADER = "X-Rollout-Attempt"
VERSION_HEADER = "X-Policy-Version"
_ROUTE = re.compile(r"^(?:/rollout/(?P<episode>[^/]+))?/v1/chat/completions$")
MAX_BODY = 16 * 2**20


def bundled_script() -> dict[str, Any]:
    raw = resources.files("rollout_worker").joinpath("data/bundled-policy.json").read_bytes()
    script: dict[str, Any] = orjson.loads(raw)
    return script


def load_script(path: Path | None) -> dict[str, Any]:
    """The bundled script, with the tasks of `path` (same format) added or replaced."""
    script = bundled_script()
    if path is not None:
        extra = orjson.loads(path.read_bytes())
        script["tasks"] = dict(script["tasks"]) | dict(extra.get("tasks", {}))
    return script


SUBMIT: dict[str, Any] = {"tool": "submit", "arguments": {}}


class ScriptedPolicy:
    """The script and the server's behaviour around it (hangs, the latency tail); no state."""

    def __init__(
        self,
        script: Mapping[str, Any],
        hang_seconds: float = 30.0,
        *,
        hangs: bool = False,
        turn_seconds: float = 0.0,
        slow_fraction: float = 0.0,
        slow_factor: float = 10.0,
    ) -> None:
        if turn_seconds < 0 or slow_factor < 0 or not 0 <= slow_fraction <= 1:
            raise ValueError("turn_seconds and slow_factor must be >= 0, slow_fraction within 0..1")
        self.tasks: dict[str, Any] = dict(script.get("tasks", {}))
        self.hang_seconds = hang_seconds
        self.hangs = hangs
        self.turn_seconds = turn_seconds
        self.slow_fraction = slow_fraction
        self.slow_factor = slow_factor

    def turn(
        self, task_id: str | None, sample: int, turn: int, bash: bool = False
    ) -> dict[str, Any]:
        """Turn `turn` of the sample's plan. `bash`: the agent offers a `bash` tool instead of
        ours (mini-swe-agent and most harnesses): its malformed replies are left out of the
        plan (such an agent drops them from the conversation, so they would come back)."""
        plans = (self.tasks.get(task_id or "") or {}).get("plans") or [[]]
        plan = plans[sample % len(plans)]
        if bash:
            plan = [t for t in plan if "text" not in t]
        chosen = plan[turn] if turn < len(plan) else SUBMIT
        if chosen.get("hang") and not self.hangs:
            return SUBMIT
        return chosen

    def is_slow(self, group_id: str | None, sample: int) -> bool:
        """Whether this sample of this group is in the slow tail: a stable hash, not a random
        draw, so a retried request (or a second look) gets the same answer."""
        if self.slow_fraction <= 0:
            return False
        digest = hashlib.sha256(f"{group_id or ''}\n{sample}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.slow_fraction

    def turn_wait(self, group_id: str | None, sample: int) -> tuple[float, bool]:
        """(seconds every turn of this sample waits before its answer, whether it is slow)."""
        slow = self.is_slow(group_id, sample)
        return self.turn_seconds * (self.slow_factor if slow else 1.0), slow


# What a `bash`-tool agent runs for each of our tools, and how it says it is done
# (mini-swe-agent's completion line: the first output line of a successful command).
BASH_DONE = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def offered_tools(request: Mapping[str, Any]) -> set[str]:
    tools = request.get("tools") or []
    return {
        str((t.get("function") or {}).get("name"))
        for t in tools
        if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
    }


def as_bash(turn: dict[str, Any], offered: set[str]) -> dict[str, Any]:
    """Our scripted turn for an agent whose only action is a shell command (`bash`): files
    written with a heredoc, read with cat, commands run as they are; `submit` is the agent's own
    submit tool when it offers one, else mini-swe-agent's completion line."""
    name, args = turn.get("tool"), dict(turn.get("arguments") or {})
    if name not in ("write_file", "read_file", "run", "submit") or name in offered:
        return turn
    if name == "submit":
        command = BASH_DONE
    elif name == "write_file":
        path, content = str(args.get("path", "")), str(args.get("content", ""))
        marker = "ROLLOUT_EOF"
        while marker in content:
            marker += "_"
        folder = path.rsplit("/", 1)[0] if "/" in path else "."
        body = content if content.endswith("\n") else content + "\n"
        command = f"mkdir -p {shlex.quote(folder)} && cat > {shlex.quote(path)} <<'{marker}'\n"
        command += f"{body}{marker}"
    elif name == "read_file":
        command = f"cat {shlex.quote(str(args.get('path', '')))}"
    else:
        command = str(args.get("command", ""))
    return turn | {"tool": "bash", "arguments": {"command": command}}


def completion(
    request: Mapping[str, Any], turn: dict[str, Any], call_id: str, version: int | None = None
) -> dict[str, Any]:
    """A chat.completion object answering `request` with the scripted `turn` (and the policy
    `version` as SGLang reports it, when given)."""
    offered = offered_tools(request)
    if "bash" in offered:
        turn = as_bash(turn, offered)
    if "tool" in turn:
        arguments = orjson.dumps(turn.get("arguments") or {}).decode()
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": turn["tool"], "arguments": arguments},
                }
            ],
        }
        finish, text = "tool_calls", turn["tool"] + arguments
    else:
        message = {"role": "assistant", "content": str(turn.get("text", ""))}
        finish, text = "stop", message["content"]
    # The answer's ids end with END, the id a real engine samples last (EOS, in vLLM's
    # token_ids too) and its template closes an assistant message with.
    tokens = [*text_ids(text), END]
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if request.get("logprobs"):
        choice["logprobs"] = {
            "content": [
                {"token": f"<{t}>", "logprob": -t / 1024, "bytes": [t], "top_logprobs": []}
                for t in tokens
            ]
        }
    prompt = render_prompt(request.get("messages", []))
    body: dict[str, Any] = {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(request.get("model", "scripted")),
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        },
    }
    if request.get("return_token_ids"):
        choice["token_ids"] = tokens
        body["prompt_token_ids"] = prompt
    if version is not None:
        body["metadata"] = {"weight_version": str(version)}
    return body


def stream_chunks(body: Mapping[str, Any], request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`body` (a chat.completion) as chat.completion.chunk objects: the role, the content in
    pieces, each tool call (its name, then its arguments in two pieces), the finish reason,
    then the usage when the request asked for it (stream_options.include_usage)."""
    choice = body["choices"][0]
    message = choice["message"]
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    if "metadata" in body:
        base["metadata"] = body["metadata"]

    def chunk(
        delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        part = {"index": 0, "delta": delta, "finish_reason": finish, **(extra or {})}
        return base | {"choices": [part]}

    logprobs = (choice.get("logprobs") or {}).get("content") or []
    # vLLM's stream: the prompt's ids on the first chunk, each chunk's sampled ids on it (all
    # here on the one chunk that carries the log-probabilities).
    sampled: dict[str, Any] = {"logprobs": {"content": logprobs}} if logprobs else {}
    if "token_ids" in choice:
        sampled["token_ids"] = choice["token_ids"]
    chunks = [chunk({"role": "assistant", "content": ""})]
    if "prompt_token_ids" in body:
        chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
    content = message.get("content") or ""
    pieces = [content[i : i + 16] for i in range(0, len(content), 16)]
    for number, piece in enumerate(pieces):
        chunks.append(chunk({"content": piece}, extra=sampled if number == 0 else {}))
    for position, call in enumerate(message.get("tool_calls") or []):
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        head = {"index": position, "id": call["id"], "type": "function"}
        chunks.append(
            chunk(
                {
                    "tool_calls": [
                        head
                        | {
                            "function": {
                                "name": call["function"]["name"],
                                "arguments": arguments[:half],
                            }
                        }
                    ]
                }
            )
        )
        chunks.append(
            chunk(
                {"tool_calls": [{"index": position, "function": {"arguments": arguments[half:]}}]}
            )
        )
    if not pieces:
        chunks[0]["choices"][0].update(sampled)
    chunks.append(chunk({}, choice["finish_reason"]))
    if (request.get("stream_options") or {}).get("include_usage"):
        chunks.append(base | {"choices": [], "usage": body["usage"]})
    return chunks


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle's algorithm the second waits for the
    # client's delayed ACK of the first (~40 ms a call on keep-alive connections).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: Any, headers: Mapping[str, str] | None = None) -> None:
        data = orjson.dumps(body)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (a timeout it was scripted to hit)

    def do_GET(self) -> None:
        if self.path == "/calls":
            with self.server.lock:
                self._send(200, list(self.server.calls))
        elif self.path == "/version":
            self._send(200, {"version": self.server.current_version()})
        elif self.path.endswith("/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        route = _ROUTE.match(path)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY or (route is None and path != "/version"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        if route is None:
            self._set_version(self.rfile.read(length))
            return
        try:
            request = orjson.loads(self.rfile.read(length))
            messages = request["messages"]
            assert isinstance(messages, list)
        except (orjson.JSONDecodeError, KeyError, TypeError, AssertionError):
            self._send(400, {"error": {"message": "body must be a chat completions request"}})
            return
        group = self.headers.get(GROUP_HEADER)
        task = self.headers.get(TASK_HEADER) or (group.rsplit(":", 1)[-1] if group else None)
        try:
            sample = int(self.headers.get(SAMPLE_HEADER) or 0)
            attempt = int(self.headers.get(ATTEMPT_HEADER) or 0)
        except ValueError:
            sample = attempt = 0
        turn_no = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        episode = route.group("episode")
        policy = self.server.policy
        wait, slow = policy.turn_wait(group, sample)
        call: dict[str, Any] = {
            "path": self.path,
            "episode_id": episode,
            "header_episode_id": self.headers.get(EPISODE_HEADER),
            "group_id": group,
            "task_id": task,
            "sample": sample,
            "attempt": attempt,
            "turn": turn_no,
            "slow": slow,
            "policy_version": None,  # the version answered with; none for a 503 or a hang
            "at": time.time(),
        }
        with self.server.lock:
            self.server.calls.append(call)
        turn = policy.turn(task, sample, turn_no, bash="bash" in offered_tools(request))
        if attempt in (turn.get("unavailable_on_attempts") or ()):
            self._send(503, {"error": {"message": f"scripted outage for attempt {attempt}"}})
            return
        if turn.get("hang"):
            time.sleep(policy.hang_seconds)
            self.close_connection = True
            return
        if wait > 0:
            time.sleep(wait)
        if turn.get("delay"):
            time.sleep(float(turn["delay"]))
        call_id = f"call-{episode or 'x'}-{turn_no}"
        # The version when the answer leaves, not when the request came: a bump during a slow
        # turn shows in that turn, as it would from a server updated mid-generation.
        with self.server.lock:
            version = self.server.version
            call["policy_version"] = version
        body = completion(request, turn, call_id, version)
        if request.get("stream"):
            self._stream(body, request, {VERSION_HEADER: str(version)})
        else:
            self._send(200, body, {VERSION_HEADER: str(version)})

    def _stream(
        self, body: dict[str, Any], request: Mapping[str, Any], headers: Mapping[str, str]
    ) -> None:
        """The same answer as server-sent events, the way OpenAI-compatible servers stream."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in stream_chunks(body, request):
                self.wfile.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass
        self.close_connection = True

    def _set_version(self, raw: bytes) -> None:
        try:
            value = orjson.loads(raw) if raw.strip() else {}
            wanted = value.get("version") if isinstance(value, dict) else "not an object"
            if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int)):
                raise ValueError(wanted)
        except (orjson.JSONDecodeError, ValueError):
            self._send(400, {"error": {"message": 'body must be {"version": <int>} or empty'}})
            return
        server = self.server
        version = server.bump_version() if wanted is None else server.set_version(wanted)
        self._send(200, {"version": version})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], policy: ScriptedPolicy, verbose: bool, version: int
    ) -> None:
        super().__init__(address, _Handler)
        self.policy = policy
        self.verbose = verbose
        self.lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []
        self.version = version

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A sandbox stopped mid-request (a cancel, a quota's abort) resets its connection:
        # expected, not worth a traceback. Anything else is still printed.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def current_version(self) -> int:
        with self.lock:
            return self.version

    def set_version(self, version: int) -> int:
        with self.lock:
            self.version = int(version)
            return self.version

    def bump_version(self) -> int:
        with self.lock:
            self.version += 1
            return self.version


class PolicyServer:
    """The scripted policy on a TCP port, served by a background thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        script: Mapping[str, Any] | None = None,
        hang_seconds: float = 30.0,
        verbose: bool = False,
        *,
        hangs: bool = False,
        turn_seconds: float = 0.0,
        slow_fraction: float = 0.0,
        slow_factor: float = 10.0,
        version: int = 0,
    ) -> None:
        policy = ScriptedPolicy(
            script if script is not None else bundled_script(),
            hang_seconds,
            hangs=hangs,
            turn_seconds=turn_seconds,
            slow_fraction=slow_fraction,
            slow_factor=slow_factor,
        )
        self._server = _Server((host, port), policy, verbose, version)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def calls(self) -> list[dict[str, Any]]:
        with self._server.lock:
            return [dict(call) for call in self._server.calls]

    @property
    def version(self) -> int:
        return self._server.current_version()

    def set_version(self, version: int) -> int:
        """Make `version` the policy version of every answer from now on; returns it."""
        return self._server.set_version(version)

    def bump_version(self) -> int:
        """The next policy version (a trainer's update); returns it."""
        return self._server.bump_version()

    def start(self) -> PolicyServer:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[PolicyServer]:
    server = PolicyServer(**kwargs).start()
    try:
        yield server
    finally:
        server.close()
