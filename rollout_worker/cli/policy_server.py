"""A small deterministic policy: an OpenAI-compatible chat completions server, scripted per task.

What the suite and the demo use instead of a model (no GPU): each task of the bundled set has
plans, lists of turns; sample n of a task follows plan n % len(plans), and the turn is the
number of assistant messages already in the conversation (the server keeps no state, so a
retried request gets the same answer). A turn is a tool call (`write_file`, `read_file`, `run`,
`submit`), a malformed reply (`text`: no tool call), a slow reply (`delay` seconds before it)
or no reply in time (`hang`). A turn with `unavailable_on_attempts` (a list of attempt
numbers, from `X-Rollout-Attempt`) answers HTTP 503 to those attempts of the episode and acts
normally for the others: an infrastructure failure that a retry in a fresh sandbox gets past.
Past its plan, or for a task it does not know, it submits.

The task comes from the `X-Rollout-Task-Id` header (else the group id's tail, `<batch>:<task>`),
the sample from `X-Rollout-Sample`. Routes: POST `/rollout/<episode id>/v1/chat/completions`
(the per-episode base URL trainers use) and `/v1/chat/completions`; GET `/v1/models`; GET
`/calls` lists what it was asked (episode, group, task, sample, turn), for tests.

Responses look like vLLM's: `logprobs` when the request asks for them, `prompt_token_ids` and
per-choice `token_ids` when it sets `return_token_ids` (made-up but deterministic values), so
trainers' code paths that keep them can be exercised.

    rollout policy-server --port 8000                 # the bundled set's script
    rollout policy-server --port 8000 --script my.json
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import orjson

GROUP_HEADER = "X-Rollout-Group-Id"
TASK_HEADER = "X-Rollout-Task-Id"
SAMPLE_HEADER = "X-Rollout-Sample"
EPISODE_HEADER = "X-Rollout-Episode-Id"
ATTEMPT_HEADER = "X-Rollout-Attempt"
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


class ScriptedPolicy:
    def __init__(self, script: Mapping[str, Any], hang_seconds: float = 30.0) -> None:
        self.tasks: dict[str, Any] = dict(script.get("tasks", {}))
        self.hang_seconds = hang_seconds

    def turn(self, task_id: str | None, sample: int, turn: int) -> dict[str, Any]:
        plans = (self.tasks.get(task_id or "") or {}).get("plans") or [[]]
        plan = plans[sample % len(plans)]
        return plan[turn] if turn < len(plan) else {"tool": "submit", "arguments": {}}


def _fake_tokens(text: str) -> list[int]:
    return list(hashlib.sha256(text.encode()).digest()[:16])


def completion(request: Mapping[str, Any], turn: dict[str, Any], call_id: str) -> dict[str, Any]:
    """A chat.completion object answering `request` with the scripted `turn`."""
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
    tokens = _fake_tokens(text)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if request.get("logprobs"):
        choice["logprobs"] = {
            "content": [
                {"token": f"<{t}>", "logprob": -t / 256, "bytes": [t], "top_logprobs": []}
                for t in tokens
            ]
        }
    prompt = orjson.dumps(request.get("messages", []))
    body: dict[str, Any] = {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(request.get("model", "scripted")),
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt) // 4,
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) // 4 + len(tokens),
        },
    }
    if request.get("return_token_ids"):
        choice["token_ids"] = tokens
        body["prompt_token_ids"] = _fake_tokens(prompt.decode())
    return body


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: Any) -> None:
        data = orjson.dumps(body)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (a timeout it was scripted to hit)

    def do_GET(self) -> None:
        if self.path == "/calls":
            with self.server.lock:
                self._send(200, list(self.server.calls))
        elif self.path.endswith("/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        route = _ROUTE.match(self.path.split("?")[0])
        length = int(self.headers.get("Content-Length") or 0)
        if route is None or length > MAX_BODY:
            self._send(404, {"error": {"message": f"no route {self.path}"}})
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
        with self.server.lock:
            self.server.calls.append(
                {
                    "path": self.path,
                    "episode_id": episode,
                    "header_episode_id": self.headers.get(EPISODE_HEADER),
                    "group_id": group,
                    "task_id": task,
                    "sample": sample,
                    "attempt": attempt,
                    "turn": turn_no,
                    "at": time.time(),
                }
            )
        turn = self.server.policy.turn(task, sample, turn_no)
        if attempt in (turn.get("unavailable_on_attempts") or ()):
            self._send(503, {"error": {"message": f"scripted outage for attempt {attempt}"}})
            return
        if turn.get("hang"):
            time.sleep(self.server.policy.hang_seconds)
            self.close_connection = True
            return
        if turn.get("delay"):
            time.sleep(float(turn["delay"]))
        call_id = f"call-{episode or 'x'}-{turn_no}"
        self._send(200, completion(request, turn, call_id))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], policy: ScriptedPolicy, verbose: bool) -> None:
        super().__init__(address, _Handler)
        self.policy = policy
        self.verbose = verbose
        self.lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []


class PolicyServer:
    """The scripted policy on a TCP port, served by a background thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        script: Mapping[str, Any] | None = None,
        hang_seconds: float = 30.0,
        verbose: bool = False,
    ) -> None:
        policy = ScriptedPolicy(script if script is not None else bundled_script(), hang_seconds)
        self._server = _Server((host, port), policy, verbose)
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
            return list(self._server.calls)

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
