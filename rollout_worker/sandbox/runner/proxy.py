"""The recording proxy: each chat completion of an agent command forwarded to the policy
and recorded as a step event."""

from __future__ import annotations

import json
import threading
import time

from .cost import LEDGER
from .errors import InfrastructureError, StalePolicy
from .policy import MAX_RESPONSE_READ, Answer, Policy, policy_version, staleness
from .proxy_server import ProxyHandler, ProxyServer, error_body, is_completion
from .steps import emit_step, turn_record
from .stream import STREAM_READ, EventStream, assemble_stream

MAX_ERROR_BODY = 2048


STALE_ANSWER = error_body(
    "the policy moved past this episode's max_policy_lag: the episode is over", "stale_policy"
)


# What an agent's request may set itself: the conversation, its tools, streaming and where
# to stop. Everything else that shapes what is sampled (temperature, top_p, n, logit_bias,
# min_tokens, top_logprobs, seeds, guided decoding, a LoRA adapter, another model) is the
# batch's: the trainer learns from samples drawn under the settings it chose.
AGENT_REQUEST_KEYS = frozenset(
    (
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "user",
    )
)


def agent_request(
    request: dict, sampling: dict, model: str, tokens: dict | None = None
) -> tuple[dict, list]:
    """(the body sent for an agent's request, the names of the agent's keys refused or
    overridden): the agent's conversation keys, then the batch's sampling over them and what
    the trainer's token view needs (`tokens`), on the batch's model."""
    sent = {k: v for k, v in request.items() if k in AGENT_REQUEST_KEYS}
    sent.update(sampling)
    sent.update(tokens or {})
    sent["model"] = model
    refused = sorted(
        k for k, v in request.items() if k != "model" and (k not in sent or sent[k] != v)
    )
    return sent, refused


class Proxy:
    """The agent's OpenAI-compatible endpoint: each chat completion goes to the episode's policy
    (Policy.send: same path, identity headers, retries) and is recorded as a step event."""

    def __init__(self, policy: Policy, identity: dict) -> None:
        self.policy = policy
        self.identity = identity
        self.lock = threading.Lock()
        self.stop = threading.Event()  # the agent must go: stale, or the policy is lost
        self.steps = 0
        self.offset = 0  # a task's earlier steps' exchanges: the step events go on numbering
        self.previous: list | None = None
        self.sequence: list = []  # the last answered turn's prompt + completion ids
        self.first_version: str | None = None
        self.failure: str | None = None
        self.stale: StalePolicy | None = None
        self.closed = False
        self.server = ProxyServer(self)
        # Polled this often for close(): a stop costs the episode at most that long.
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def start(self) -> Proxy:
        self.thread.start()
        return self

    def close(self) -> None:
        """Nothing counts after this: exchanges still in flight are neither recorded nor can
        they change the outcome (the log would not show why)."""
        with self.lock:
            self.closed = True
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def fail(self, cause: str) -> None:
        with self.lock:
            if not self.closed:
                self.failure = self.failure or cause
                self.stop.set()

    def too_stale(self, version: str | None) -> bool:
        """Whether `version` lags the first exchange's by more than max_policy_lag (then the
        episode is stale and the agent is stopped)."""
        bound = self.policy.max_policy_lag
        with self.lock:
            if self.stale is not None or self.closed:
                return self.stale is not None
            # Before the first recorded exchange there is no first version to lag behind.
            self.stale = staleness(self.first_version, version, bound, self.steps)
            if self.stale is None:
                return False
            self.stop.set()
            return True

    def exchange(self, handler: ProxyHandler, request: dict) -> None:
        if self.stop.is_set():
            handler.send_json(
                409 if self.stale is not None else 502,
                error_body("the episode is over: no more completions", "rollout_stopped"),
            )
            return
        policy = self.policy
        sent, refused = agent_request(request, policy.sampling, policy.model, policy.token_request)
        asked = time.time()
        try:
            answer = self.policy.send(
                json.dumps(sent).encode(), keep_open=sent.get("stream") is True
            )
        except InfrastructureError as exc:
            lost = Answer(0, b"", None, self.policy.retries + 1, "")
            self.record(sent, asked, lost, failure=str(exc), error=str(exc), refused=refused)
            handler.send_json(502, error_body(str(exc), "policy_unreachable"))
            return
        relay = self.relay_stream if answer.response is not None else self.relay
        relay(handler, sent, asked, answer, refused)

    def relay(
        self, handler: ProxyHandler, sent: dict, asked: float, answer: Answer, refused: list
    ) -> None:
        raw, status = answer.raw, answer.status
        if len(raw) > MAX_RESPONSE_READ:
            # What the policy generated under the batch's settings: the agent's turn, told
            # so, never an infrastructure failure (that would erase the sample).
            cause = f"policy response exceeds {MAX_RESPONSE_READ} bytes"
            self.record(sent, asked, answer, error=cause, refused=refused)
            handler.send_json(502, error_body(cause, "policy_response_too_large"))
            return
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        version = policy_version(answer.header, parsed)
        failure = None
        if status == 200 and is_completion(parsed):
            if self.too_stale(version):
                LEDGER.turn(parsed, time.time() - asked)  # answered, though never recorded
                handler.send_json(409, STALE_ANSWER)
                return
        elif status == 200:
            failure = f"policy endpoint sent no chat completion: {raw[:200]!r}"
        elif status == 429 or status >= 500:
            failure = (
                f"policy endpoint answered HTTP {status}: {raw[:200]!r} "
                f"(after {answer.attempts} attempt(s))"
            )
        ok = status == 200 and failure is None
        self.record(
            sent,
            asked,
            answer,
            version=version,
            response=parsed if ok else None,
            raw=raw,
            failure=failure,
            error=None if ok else raw[:MAX_ERROR_BODY].decode("utf-8", "replace"),
            refused=refused,
        )
        # Recorded before the agent reads it: its next request finds this step in the log.
        handler.send_body(status, raw, answer.content_type, answer.header)

    def relay_stream(
        self, handler: ProxyHandler, sent: dict, asked: float, answer: Answer, refused: list
    ) -> None:
        conn, upstream = answer.conn, answer.response
        assert conn is not None and upstream is not None
        if self.too_stale(policy_version(answer.header, None)):
            conn.close()
            LEDGER.turn(None, time.time() - asked)
            handler.send_json(409, STALE_ANSWER)
            return
        handler.start_stream(answer.header)
        events = EventStream()
        held: list = []
        problem = None
        too_large = False
        try:
            while True:
                data = upstream.read1(STREAM_READ)
                if not data:
                    break
                for raw, done in events.feed(data):
                    # [DONE] waits until the exchange is recorded, as a whole answer does.
                    if done or held:
                        held.append(raw)
                    else:
                        handler.send_chunk(raw)
                if events.size > MAX_RESPONSE_READ:
                    problem = f"policy response exceeds {MAX_RESPONSE_READ} bytes"
                    too_large = True  # the agent's turn, as a whole answer's (relay)
                    break
        except OSError as exc:  # WireError (a malformed stream) too
            problem = f"policy stream cut: {type(exc).__name__}: {exc}"
        finally:
            conn.close()
        if problem is None and not events.chunks:
            problem = "policy endpoint sent an event stream without chunks"
        assembled = assemble_stream(events.chunks)
        version = policy_version(answer.header, assembled)
        if problem is None and self.too_stale(version):
            LEDGER.turn(assembled, time.time() - asked)
            handler.close_connection = True  # no end: the agent is stopped anyway
            return
        self.record(
            sent,
            asked,
            answer,
            version=version,
            response=assembled if events.chunks else None,
            raw=json.dumps(assembled).encode(),
            failure=None if too_large else problem,
            error=problem,
            chunks=len(events.chunks),
            refused=refused,
        )
        if problem is not None:
            handler.close_connection = True  # cut, as the agent would have seen it
            return
        handler.send_chunk(b"".join(held) + events.buffer, last=True)

    def record(
        self,
        sent: dict,
        asked: float,
        answer: Answer,
        *,
        version: str | None = None,
        response: dict | None = None,
        raw: bytes = b"",
        failure: str | None = None,
        error: str | None = None,
        chunks: int | None = None,
        refused: list | None = None,
    ) -> None:
        answered = time.time()
        with self.lock:
            if self.closed:
                return
            LEDGER.turn(response, answered - asked)
            if failure is not None:
                self.failure = self.failure or failure
                self.stop.set()
            self.steps += 1
            messages = sent["messages"]
            previous = self.previous
            reset = previous is not None and messages[: len(previous)] != previous
            new = messages if previous is None or reset else messages[len(previous) :]
            self.previous = messages
            if self.steps == 1:
                self.first_version = version
            verbatim: object = response
            tokens = None
            if response is not None:
                token_request = self.policy.token_request
                tokens, self.sequence, verbatim = turn_record(
                    token_request, response, raw, self.sequence
                )
            fields: dict = {
                "step": self.offset + self.steps,
                "request": {k: v for k, v in sent.items() if k != "messages"},
                "new_messages": new,
                "messages_reset": reset,
                "response": verbatim,
                "status": answer.status or None,
                "error": error,
                "stream": chunks is not None,
                "policy_seconds": answered - asked,
                "policy_attempts": answer.attempts,
                "policy_version": version,
            }
            if tokens is not None:
                fields["tokens"] = tokens
            if chunks is not None:
                fields["chunks"] = chunks
            if refused:
                fields["request_refused"] = refused
            emit_step(fields, self.identity)
