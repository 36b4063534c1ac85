"""A real engine for training tests: a tiny causal language model on the CPU, built at random
in the process (nothing downloaded), served through an OpenAI-compatible chat completions
endpoint shaped like vLLM's.

Tokenizer and chat template (rollout_wire/byte_template.py, shared with the scripted policy
server so both render a conversation to the same ids): a byte b is the id b + 16; ids 0-15 are
special (PAD 0, START 1, END 2, the roles system 3, user 4, assistant 5, tool 6, the rest
reserved); 272 ids in all. Each message renders as [START, role] + its body + [END], an
assistant message's body being the ids of its text (or of each tool call's name + arguments);
a prompt ends with [START, assistant]. END is the EOS the model stops at, so an answer that is
carried back unchanged (and whose bytes are UTF-8) makes the next prompt append-only.
Completion ids decode to text as their bytes (special ids dropped), invalid UTF-8 replaced.

- `build_model(seed)`: a 2-layer Llama of hidden size 64 (about 100k parameters), random.
- `build_tokenizer()`: the same vocabulary as a transformers fast tokenizer (byte-level, no
  merges; every special id skipped by `skip_special_tokens`), for TRL's `processing_class`:
  with a `rollout_func`, GRPOTrainer needs a `PreTrainedTokenizerBase` with `pad_token_id`,
  `eos_token_id` (END: its completion mask ends at the first one), `bos_token_id` and
  `batch_decode(ids, skip_special_tokens=True)` (the completions its reward functions see,
  equal to the engine's own decoding); it renders no prompt, so no chat template is set.
- `EngineServer(model)`, a background thread serving:
  - POST `/v1/chat/completions` and `/rollout/<episode>/v1/chat/completions`: samples with the
    model (`temperature`, 0 greedy; `top_p`; `seed`; `max_tokens` up to 256; n = 1; `tools`
    accepted and ignored) and answers as vLLM does: each choice's `token_ids` (END included,
    as vLLM includes EOS) and the top-level `prompt_token_ids` when `return_token_ids` is set,
    `logprobs` when asked (`top_logprobs` up to 20), `usage`, and the weight version in
    `metadata.weight_version` and the `X-Policy-Version` header. A `stream` gets the same
    answer as server-sent chunks. A bad request gets a 400 with an OpenAI-shaped error.
  - GET `/v1/models`, `/version`, `/health`.
  - POST `/weights`: a `torch.save`d state dict as the body, or JSON {"path", "version"} naming
    such a file; the version becomes the `X-Policy-Version` header's (or the JSON's), else
    the next one. Answers {"version": n}.
  In process: `update_weights`, `set_version`, `paused()`, `ledger()` (what each episode was
  shown and sampled, to check a trajectory against), `complete(body)`.

The log-probability reported for a token is the one it was sampled with, from the same
forward pass (KV cache, one token a step): log_softmax(logits / temperature), or of the raw
logits when greedy. That is what a trainer recomputes, so a teacher-forced pass over the same
ids agrees (no drift). With top_p < 1 the token is drawn from the nucleus, but its reported
log-probability stays the full tempered distribution's (TRL's own recomputation ignores top_p).

The model may be shared with a trainer in the same process: sampling holds `lock` (requests
are served one at a time; 2 cores), runs under `torch.no_grad` in eval mode and puts the
model's mode back after. A trainer that steps while requests may be in flight wraps its step
in `with server.paused():` so no answer mixes two versions of the weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rollout_wire.byte_template import (
    BYTE_OFFSET,
    END,
    ROLE_IDS,
    START,
    VOCAB_SIZE,
    decode,
    render_prompt,
)

__all__ = [
    "END",
    "START",
    "VOCAB_SIZE",
    "BadRequest",
    "EngineServer",
    "build_model",
    "build_tokenizer",
    "decode",
    "render_prompt",
    "sample",
]

PAD = 0
MAX_TOKENS = 256
DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
MODEL_NAME = "tiny"
MAX_BODY_BYTES = 64 * 2**20  # a state dict of this model is ~0.6 MB
VERSION_HEADER = "X-Policy-Version"

# Names of the special ids, for the tokenizer and the `token` of a log-probability entry.
_NAMED = {PAD: "<pad>", START: "<s>", END: "</s>"} | {n: f"<{r}>" for r, n in ROLE_IDS.items()}
SPECIAL_NAMES = [_NAMED.get(i, f"<reserved{i}>") for i in range(BYTE_OFFSET)]


def build_model(seed: int = 0) -> Any:
    """A tiny Llama at random (seeded): small enough to sample and train on a CPU in CI."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=START,
        eos_token_id=END,
        pad_token_id=PAD,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _byte_chars() -> list[str]:
    """The character the `tokenizers` ByteLevel pre-tokenizer and decoder use for each byte
    (printable Latin-1 stands for itself, the other bytes for code points from 256 on)."""
    shown = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spare = iter(range(256, 512))
    return [chr(b) if b in shown else chr(next(spare)) for b in range(256)]


def build_tokenizer() -> Any:
    """The template's vocabulary as a transformers fast tokenizer: text encodes to its bytes'
    ids (`text_ids`; special names in text are bytes too, as the template has it), and
    `decode(ids, skip_special_tokens=True)` equals `decode` here (the ByteLevel decoder joins
    the bytes and replaces invalid UTF-8 as Python's "replace" does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: BYTE_OFFSET + b for b, char in enumerate(_byte_chars())}
    vocab |= {name: i for i, name in enumerate(SPECIAL_NAMES)}
    # BPE without merges: every byte stays its own token.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in SPECIAL_NAMES])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_NAMES[PAD],
        bos_token=SPECIAL_NAMES[START],
        eos_token=SPECIAL_NAMES[END],
        additional_special_tokens=SPECIAL_NAMES[3:],
        # Decoded text must be the bytes as sampled, not "cleaned" of spaces.
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        model_max_length=2048,
    )


class Sampled(NamedTuple):
    ids: list[int]
    logprobs: list[float]  # each id's, under the distribution it was drawn from
    finish: str  # "stop" (END sampled) or "length"
    top: list[list[tuple[int, float]]]  # per step, the `top_logprobs` most likely ids


def sample(
    model: Any,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    top_logprobs: int = 0,
) -> Sampled:
    """Decode one token at a time over the model's KV cache (the caller sets eval mode)."""
    ids: list[int] = []
    logprobs: list[float] = []
    top: list[list[tuple[int, float]]] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        for _ in range(max_tokens):
            logits = out.logits[0, -1].float()
            logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
            if temperature <= 0:
                token = int(torch.argmax(logp))
            else:
                probs = logp.exp()
                if top_p < 1.0:
                    # The smallest set of most likely ids whose mass reaches top_p.
                    ordered, order = torch.sort(probs, descending=True)
                    keep = torch.cumsum(ordered, 0) - ordered < top_p
                    probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
                token = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
            if top_logprobs:
                values, indices = torch.topk(logp, top_logprobs)
                top.append(list(zip(indices.tolist(), values.tolist(), strict=True)))
            if token == END:
                return Sampled(ids, logprobs, "stop", top)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return Sampled(ids, logprobs, "length", top)


class BadRequest(ValueError):
    """A request vLLM would refuse with HTTP 400; the message says why."""


@dataclass
class _Request:
    messages: list[Any]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    model: str


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number within [{low}, {high}]")
    return float(value)


def _integer(body: Mapping[str, Any], key: str, default: int | None, low: int, high: int) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer within [{low}, {high}]")
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean")
    return bool(value)


def parse_request(body: Any) -> _Request:
    """The sampling parameters of a chat completions request (BadRequest for what vLLM would
    refuse); the fields it does not use (tools, tool_choice, ...) are accepted."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a list of message objects")
    if _integer(body, "n", 1, 1, sys.maxsize) != 1:
        raise BadRequest("n must be 1")
    _flag(body, "stream")
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    return _Request(
        messages=messages,
        max_tokens=_integer(body, key, DEFAULT_MAX_TOKENS, 1, MAX_TOKENS),
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        logprobs=_flag(body, "logprobs"),
        top_logprobs=_integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS),
        return_token_ids=_flag(body, "return_token_ids"),
        model=str(body.get("model") or MODEL_NAME),
    )


def _entry(token: int, logprob: float) -> dict[str, Any]:
    """A log-probability entry as OpenAI's API has it: the token's text, its bytes."""
    if token < BYTE_OFFSET:
        text = SPECIAL_NAMES[token]
        raw = list(text.encode())
    else:
        text, raw = decode([token]), [token - BYTE_OFFSET]
    # JSON has no -inf; only a token of probability 0 under float32 gets here.
    return {"token": text, "logprob": logprob if math.isfinite(logprob) else -9999.0, "bytes": raw}


def stream_chunks(answer: Mapping[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A chat.completion as the chat.completion.chunk objects of a stream, vLLM's way: the role
    (with `prompt_token_ids`), the content with its ids and log-probabilities, the finish
    reason, then the usage when the request asked (stream_options.include_usage)."""
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "created", "model", "metadata")}
    base["object"] = "chat.completion.chunk"

    def chunk(part: dict[str, Any]) -> dict[str, Any]:
        return base | {"choices": [{"index": 0, "finish_reason": None} | part]}

    first = chunk({"delta": {"role": "assistant", "content": ""}})
    if "prompt_token_ids" in answer:
        first["prompt_token_ids"] = answer["prompt_token_ids"]
    body = chunk({"delta": {"content": choice["message"]["content"]}})
    for key in ("logprobs", "token_ids"):
        if key in choice:
            body["choices"][0][key] = choice[key]
    chunks = [first, body, chunk({"delta": {}, "finish_reason": choice["finish_reason"]})]
    if include_usage:
        chunks.append(base | {"choices": [], "usage": answer["usage"]})
    return chunks


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: EngineServer) -> None:
        super().__init__(address, _Handler)
        self.engine = engine

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up mid-answer is expected; anything else still gets a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class EngineServer:
    """The model behind an OpenAI-compatible endpoint (see the module's text)."""

    def __init__(
        self, model: Any, host: str = "127.0.0.1", port: int = 0, version: int = 0
    ) -> None:
        self.model = model
        # Reentrant, so a trainer holding `paused()` may still call set_version/update_weights.
        self.lock = threading.RLock()
        self._version = int(version)
        self._ledger: dict[str, list[dict[str, Any]]] = {}
        self.http = _HTTPServer((host, port), self)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def version(self) -> int:
        return self._version

    def start(self) -> EngineServer:
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread.is_alive():  # shutdown() would wait forever for a loop never started
            self.http.shutdown()
        self.http.server_close()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_version(self, version: int) -> None:
        with self.lock:
            self._version = int(version)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No request samples while this is held: for a trainer changing the shared model."""
        with self.lock:
            yield

    def update_weights(self, state_dict: Mapping[str, Any], version: int | None = None) -> int:
        """Load new weights (no request sees half of them) and bump or set the version."""
        with self.lock:
            self.model.load_state_dict(state_dict)
            self._version = self._version + 1 if version is None else int(version)
            return self._version

    def ledger(self) -> dict[str, list[dict[str, Any]]]:
        """Per episode (its request path's name; "" for /v1), each turn it was answered: the
        prompt ids the model was shown, the ids it sampled and their log-probabilities."""
        with self.lock:
            return {k: list(v) for k, v in self._ledger.items()}

    def complete(self, body: Any, episode: str = "") -> tuple[dict[str, Any], int]:
        """(a chat.completion answering request `body`, the weight version it was sampled
        with); BadRequest for what vLLM would refuse. `stream` is the caller's business."""
        request = parse_request(body)
        prompt = render_prompt(request.messages)
        generator = None
        if request.seed is not None:
            generator = torch.Generator().manual_seed(request.seed)
        with self.lock:
            training = self.model.training
            self.model.eval()
            try:
                done = sample(
                    self.model,
                    prompt,
                    max_tokens=request.max_tokens,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    generator=generator,
                    top_logprobs=request.top_logprobs if request.logprobs else 0,
                )
            finally:
                self.model.train(training)
            version = self._version
            self._ledger.setdefault(episode, []).append(
                {"prompt_ids": prompt, "completion_ids": done.ids, "logprobs": done.logprobs}
            )
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": decode(done.ids)},
            "finish_reason": done.finish,
        }
        if request.logprobs:
            content = []
            for n, (token, logprob) in enumerate(zip(done.ids, done.logprobs, strict=True)):
                alternatives = [_entry(t, lp) for t, lp in done.top[n]] if done.top else []
                content.append(_entry(token, logprob) | {"top_logprobs": alternatives})
            choice["logprobs"] = {"content": content}
        if request.return_token_ids:
            choice["token_ids"] = done.ids
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(done.ids),
                "total_tokens": len(prompt) + len(done.ids),
            },
            "metadata": {"weight_version": str(version)},
        }
        if request.return_token_ids:
            answer["prompt_token_ids"] = prompt
        return answer, version

    def load_weights(self, raw: bytes, content_type: str, header: str | None) -> int:
        """POST /weights: a torch.save'd state dict, or JSON {path, version} naming one."""
        try:
            version = None if header is None else int(header)
        except ValueError:
            raise BadRequest(f"{VERSION_HEADER} must be an integer") from None
        source: Any = io.BytesIO(raw)
        if content_type.startswith("application/json"):
            try:
                spec = json.loads(raw)
            except ValueError:
                raise BadRequest("the body is not JSON") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
                raise BadRequest('a JSON body names a checkpoint: {"path": ..., "version": n}')
            if spec.get("version") is not None:
                if isinstance(spec["version"], bool) or not isinstance(spec["version"], int):
                    raise BadRequest("version must be an integer")
                version = spec["version"]
            source = Path(spec["path"])
        try:
            # weights_only: a body is untrusted input, never unpickled as code.
            state = torch.load(source, map_location="cpu", weights_only=True)
        except Exception as exc:  # unreadable file, not a torch.save archive, ...
            raise BadRequest(f"the weights could not be read: {exc}") from None
        if not isinstance(state, dict):
            raise BadRequest("the weights are not a state dict")
        try:
            return self.update_weights(state, version)
        except RuntimeError as exc:  # missing or unexpected keys, wrong shapes
            raise BadRequest(f"the weights do not fit the model: {exc}") from None


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle's algorithm the second waits for the
    # client's delayed ACK of the first (~40 ms a call on keep-alive connections).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any, version: int | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if version is not None:
            self.send_header(VERSION_HEADER, str(version))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "internal_server_error"
        self._send(
            status, {"error": {"message": message, "type": kind, "param": None, "code": None}}
        )

    def _stream(self, chunks: list[dict[str, Any]], version: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header(VERSION_HEADER, str(version))
        # No length ahead: the end of the stream is the end of the connection.
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        engine = self.server.engine
        if path.endswith("/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
        elif path == "/version":
            self._send(200, {"version": engine.version}, engine.version)
        elif path == "/health":
            self._send(200, {})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self._error(413 if length > 0 else 400, "a body of at most 64 MiB, with its length")
            self.close_connection = True
            return
        raw = self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        engine = self.server.engine
        try:
            if path == "/weights":
                kind = self.headers.get("Content-Type") or ""
                version = engine.load_weights(raw, kind, self.headers.get(VERSION_HEADER))
                self._send(200, {"version": version}, version)
                return
            parts = path.strip("/").split("/")
            if parts[-3:] != ["v1", "chat", "completions"] or (
                len(parts) != 3 and (len(parts) != 5 or parts[0] != "rollout")
            ):
                self._error(404, f"no route {path}")
                return
            try:
                body = json.loads(raw)
            except ValueError:
                raise BadRequest("the body is not JSON") from None
            answer, version = engine.complete(body, parts[1] if len(parts) == 5 else "")
            if body.get("stream"):
                options = body.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                self._stream(stream_chunks(answer, usage), version)
            else:
                self._send(200, answer, version)
        except BadRequest as exc:
            self._error(400, str(exc))
        except (ConnectionError, TimeoutError):
            raise
        except Exception as exc:  # a bug answers 500 rather than dropping the connection
            self._error(500, f"{type(exc).__name__}: {exc}")
