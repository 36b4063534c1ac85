"""A real engine for training tests: a tiny causal language model on the CPU, built at random
in the process (nothing downloaded), served through an OpenAI-compatible chat completions
endpoint shaped like vLLM's.

- Tokenizer and chat template: rollout_wire/byte_template.py (byte-level, 272 ids; END is the
  EOS the model stops at). `build_tokenizer()` is the same vocabulary as a transformers fast
  tokenizer, for trainers that want a `processing_class` (TRL decodes completions with it).
- `build_model(seed)`: a 2-layer Llama of hidden size 64 (about 140k parameters).
- `EngineServer(model)`: POST `/v1/chat/completions` and `/rollout/<episode>/v1/chat/
  completions` sample with the model (temperature, top-p, max_tokens up to 256, n = 1; no
  streams) and answer as vLLM does: each choice's `token_ids` (END included, as vLLM includes
  EOS) and the top-level `prompt_token_ids` when `return_token_ids` is set, `logprobs` (the
  log-probability each token was sampled with, from the same forward pass) when asked,
  `usage`, and the weight version in `metadata.weight_version` and `X-Policy-Version`.
  GET `/v1/models`, GET `/version`; POST `/weights` takes a `torch.save`d state dict (or JSON
  {path, version}: a checkpoint file) and bumps the version (or sets the `X-Policy-Version`
  header's). In process: `update_weights`, `set_version`, `ledger()` (what each episode was
  shown and sampled, to check a trajectory against).
- It may share its model with a trainer in the same process: sampling holds a lock, runs
  under `torch.no_grad` in eval mode and puts the model's mode back after.
"""

from __future__ import annotations

import io
import json
import math
import threading
import time
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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

PAD = 0
MAX_TOKENS = 256
DEFAULT_MAX_TOKENS = 16
MODEL_NAME = "tiny"
MAX_BODY_BYTES = 64 * 2**20  # a state dict of this model is ~0.6 MB


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


def build_tokenizer() -> Any:
    """The byte template's vocabulary as a transformers fast tokenizer (decoding only matters:
    prompts are rendered by the template): bytes as <0xNN> tokens, which a byte-fallback
    decoder turns back into text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    names = {PAD: "<pad>", START: "<s>", END: "</s>"}
    names |= {number: f"<{role}>" for role, number in ROLE_IDS.items()}
    vocab = {names.get(i, f"<reserved{i}>"): i for i in range(BYTE_OFFSET)}
    vocab |= {f"<0x{b:02X}>": BYTE_OFFSET + b for b in range(256)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=[f"<{role}>" for role in ROLE_IDS],
    )


def sample(
    model: Any,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float], str]:
    """(completion ids, the log-probability each was sampled with, finish reason), decoding
    one token at a time over the model's KV cache."""
    ids: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            logits = out.logits[0, -1].float()
            scaled = logits / temperature if temperature > 0 else logits
            logp = torch.log_softmax(scaled, dim=-1)
            if temperature <= 0:
                token = int(torch.argmax(logp))
            else:
                probs = logp.exp()
                if top_p < 1.0:
                    ordered, order = torch.sort(probs, descending=True)
                    keep = torch.cumsum(ordered, 0) - ordered < top_p
                    probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
                token = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token == END:
                return ids, logprobs, "stop"
            out = model(
                input_ids=torch.tensor([[token]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return ids, logprobs, "length"


class BadRequest(ValueError):
    pass


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number within [{low}, {high}]")
    return float(value)


class EngineServer:
    """The model behind an OpenAI-compatible endpoint (see the module's text)."""

    def __init__(
        self, model: Any, host: str = "127.0.0.1", port: int = 0, version: int = 0
    ) -> None:
        self.model = model
        self.lock = threading.Lock()
        self._version = version
        self._ledger: dict[str, list[dict[str, Any]]] = {}
        self.http = ThreadingHTTPServer((host, port), _Handler)
        self.http.daemon_threads = True
        self.http.engine = self  # type: ignore[attr-defined]
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
        self.http.shutdown()
        self.http.server_close()

    def set_version(self, version: int) -> None:
        with self.lock:
            self._version = int(version)

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

    def complete(self, body: Any, episode: str) -> tuple[dict[str, Any], int]:
        """A chat.completion for request `body` (BadRequest for what vLLM would refuse)."""
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise BadRequest("messages must be a list")
        if body.get("stream"):
            raise BadRequest("stream is not supported by this engine")
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1")
        limit = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_TOKENS:
            raise BadRequest(f"max_tokens must be an integer within [1, {MAX_TOKENS}]")
        temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
        top_p = _number(body, "top_p", 1.0, 1e-6, 1.0)
        generator = None
        if isinstance(body.get("seed"), int):
            generator = torch.Generator().manual_seed(int(body["seed"]))
        prompt = render_prompt(body["messages"])
        with self.lock:
            training = self.model.training
            self.model.eval()
            try:
                ids, logprobs, finish = sample(
                    self.model,
                    prompt,
                    max_tokens=limit,
                    temperature=temperature,
                    top_p=top_p,
                    generator=generator,
                )
            finally:
                self.model.train(training)
            version = self._version
            self._ledger.setdefault(episode, []).append(
                {"prompt_ids": prompt, "completion_ids": ids, "logprobs": logprobs}
            )
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": decode(ids)},
            "finish_reason": finish,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": decode([t]),
                        "logprob": lp if math.isfinite(lp) else -9999.0,
                        "bytes": [t - BYTE_OFFSET] if t >= BYTE_OFFSET else [],
                        "top_logprobs": [],
                    }
                    for t, lp in zip(ids, logprobs, strict=True)
                ]
            }
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or MODEL_NAME),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
            "metadata": {"weight_version": str(version)},
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            answer["prompt_token_ids"] = prompt
        return answer, version

    def load_weights(self, raw: bytes, content_type: str, header: str | None) -> int:
        """POST /weights: a torch.save'd state dict, or JSON {path, version}."""
        version = int(header) if header and header.isdigit() else None
        if content_type.startswith("application/json"):
            spec = json.loads(raw)
            if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
                raise BadRequest("a JSON body names the checkpoint: {path, version}")
            state = torch.load(spec["path"], map_location="cpu", weights_only=True)
            if isinstance(spec.get("version"), int):
                version = spec["version"]
        else:
            state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise BadRequest("the weights are not a state dict")
        try:
            return self.update_weights(state, version)
        except RuntimeError as exc:  # missing or unexpected keys, wrong shapes
            raise BadRequest(f"the weights do not fit the model: {exc}") from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle's algorithm the second waits for the
    # client's delayed ACK of the first (~40 ms a call on keep-alive connections).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def engine(self) -> EngineServer:
        return self.server.engine  # type: ignore[attr-defined]

    def _send(self, status: int, body: Any, version: int | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if version is not None:
            self.send_header("X-Policy-Version", str(version))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        self._send(status, {"error": error})

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
        elif self.path == "/version":
            self._send(200, {"version": self.engine.version})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 <= length <= MAX_BODY_BYTES:
            self._error(413, "the body is too large")
            self.close_connection = True
            return
        raw = self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        try:
            if path == "/weights":
                kind = self.headers.get("Content-Type") or ""
                version = self.engine.load_weights(raw, kind, self.headers.get("X-Policy-Version"))
                self._send(200, {"version": version}, version)
                return
            parts = path.strip("/").split("/")
            if parts[-3:] != ["v1", "chat", "completions"] or len(parts) not in (3, 5):
                self._error(404, f"no route {path}")
                return
            episode = parts[1] if len(parts) == 5 and parts[0] == "rollout" else ""
            try:
                body = json.loads(raw)
            except ValueError:
                raise BadRequest("the body is not JSON") from None
            answer, version = self.engine.complete(body, episode)
            self._send(200, answer, version)
        except BadRequest as exc:
            self._error(400, str(exc))
