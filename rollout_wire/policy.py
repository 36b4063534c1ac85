"""A real rollout's policy endpoint: parsed once (by `parse_spec`), then used as a typed value.

A batch request carries its policy as a JSON object {url, model, sampling,
request_timeout_seconds, max_retries}; `parse_policy` checks it and returns a `PolicyEndpoint`,
whose URL is taken apart once, at construction: scheme, host, port, path, and whether the host
is an IP address (a Kubernetes NetworkPolicy matches addresses, not names). Everything a
consumer needs comes from here: the runner's `ROLLOUT_POLICY` configuration (`runner_json`),
the (host, port) a warm pool's shape names (`endpoint`), the egress CIDR (`cidr`).

On the wire (the request, a stored receipt) the policy stays the plain object it always was:
`to_dict` / `from_dict` give and take exactly those five keys.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

DEFAULT_MODEL = "policy"
DEFAULT_REQUEST_TIMEOUT_SECONDS = 60
DEFAULT_MAX_RETRIES = 2
MAX_REQUEST_TIMEOUT_SECONDS = 600
MAX_RETRIES = 10
# The policy object's fields, in their wire order.
WIRE_FIELDS = (
    "url",
    "model",
    "sampling",
    "request_timeout_seconds",
    "max_retries",
    "max_policy_lag",
    "trainer",
    "tokens",
)
DEFAULT_TRAINER = "default"
_TRAINER = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# What the runner sends itself; sampling parameters may not override them.
_RUNNER_OWNED = {"model", "messages", "tools", "tool_choice", "stream", "n"}
_URL = re.compile(r"^https?://[A-Za-z0-9.-]+(:(?P<port>[0-9]{1,5}))?(/[A-Za-z0-9._~/-]*)?$")


def default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


@dataclass(frozen=True)
class PolicyEndpoint:
    """Where and how episodes ask the policy for actions.

    `url` is the server's root (episodes call <url>/rollout/<episode id>/v1/chat/completions);
    the parts after `max_retries` are worked out from it at construction, never passed.
    Constructing one with a URL whose port is out of range raises ValueError.
    """

    url: str
    model: str = DEFAULT_MODEL
    sampling: dict[str, Any] = field(default_factory=dict)
    request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS
    max_retries: int = DEFAULT_MAX_RETRIES
    # The staleness bound: an episode whose first turn is more than this many policy versions
    # behind its trainer's published version is stopped and recorded `stale` (None: no bound).
    max_policy_lag: int | None = None
    # Whose published policy version (`RolloutClient.publish_policy_version`) the bound reads.
    trainer: str = DEFAULT_TRAINER
    # Whether every turn asks the server for its token ids and log-probabilities (vLLM's and
    # SGLang's `return_token_ids`, `logprobs`): the trainer's token view. False for a server
    # that refuses those fields.
    tokens: bool = True
    # Parsed from `url` (derived: not compared, not on the wire).
    scheme: str = field(init=False, repr=False, compare=False)
    host: str = field(init=False, repr=False, compare=False)
    port: int = field(init=False, repr=False, compare=False)
    path: str = field(init=False, repr=False, compare=False)
    # 4 or 6 when the host is an IP address, None for a name.
    ip_version: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        try:
            version: int | None = ipaddress.ip_address(host).version
        except ValueError:
            version = None
        derived = {
            "scheme": parts.scheme,
            "host": host,
            "port": parts.port if parts.port is not None else default_port(parts.scheme),
            "path": parts.path.rstrip("/"),
            "ip_version": version,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def is_ip(self) -> bool:
        """Whether the host is an IP address (a NetworkPolicy can only match those)."""
        return self.ip_version is not None

    @property
    def endpoint(self) -> tuple[str, int]:
        """(host, port): where the policy server listens."""
        return self.host, self.port

    @property
    def cidr(self) -> str:
        """The host alone as a CIDR block (/32 for IPv4, /128 for IPv6), for a NetworkPolicy's
        ipBlock. ValueError when the host is a name: a NetworkPolicy cannot match names."""
        if self.ip_version is None:
            raise ValueError(
                f"policy host {self.host!r} is not an IP address: a NetworkPolicy matches "
                "addresses, not names"
            )
        return f"{self.host}/{32 if self.ip_version == 4 else 128}"

    def runner_config(self) -> dict[str, Any]:
        """What the agent runner reads from ROLLOUT_POLICY: the policy without its URL (the
        runner reaches the policy by ROLLOUT_POLICY_URL or the local backend's socket)."""
        config: dict[str, Any] = {
            "model": self.model,
            "sampling": dict(self.sampling),
            "request_timeout_seconds": self.request_timeout_seconds,
            "max_retries": self.max_retries,
        }
        if self.max_policy_lag is not None:
            # The runner stops an episode whose policy moved on too far (it sees the version
            # of every turn); without a bound the configuration is as before.
            config["max_policy_lag"] = self.max_policy_lag
        if not self.tokens:
            config["tokens"] = False
        return config

    def runner_json(self) -> str:
        """The value of the runner's ROLLOUT_POLICY variable (JSON of `runner_config`)."""
        return orjson.dumps(self.runner_config()).decode()

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the request's policy object, with every default filled in."""
        config = self.runner_config()
        config.pop("max_policy_lag", None)
        config.pop("tokens", None)
        return {
            "url": self.url,
            **config,
            "max_policy_lag": self.max_policy_lag,
            "trainer": self.trainer,
            "tokens": self.tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyEndpoint:
        """Decode a policy validated before (a stored receipt); no limits are re-applied."""
        return cls(**dict(data))


def parse_policy(value: Any, problems: list[str]) -> PolicyEndpoint | None:
    """Check a request's policy object ({url, model, sampling, request_timeout_seconds,
    max_retries}), appending every problem to `problems`.

    None when there is no policy, or its URL cannot be used; otherwise the endpoint (with the
    defaults in place of fields found wrong: the caller raises when `problems` grew).
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append("policy must be an object {url, model, sampling}")
        return None
    unknown = sorted(set(value) - set(WIRE_FIELDS))
    if unknown:
        problems.append(f"unknown policy fields {unknown}; allowed: {sorted(WIRE_FIELDS)}")
    url = value.get("url")
    match = _URL.match(url) if isinstance(url, str) else None
    usable = match is not None and 0 < int(match.group("port") or 80) <= 65535
    if not usable:
        problems.append(
            f"policy.url {url!r} must be an http(s) URL like 'http://10.0.0.5:8000' (the "
            "server's root: episodes call <url>/rollout/<episode id>/v1/chat/completions)"
        )
    model = value.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model:
        problems.append("policy.model must be a non-empty string")
        model = DEFAULT_MODEL
    sampling = value.get("sampling") or {}
    if not isinstance(sampling, Mapping):
        problems.append("policy.sampling must be an object (temperature, top_p, max_tokens, ...)")
        sampling = {}
    owned = sorted(set(sampling) & _RUNNER_OWNED)
    if owned:
        problems.append(f"policy.sampling may not set {owned}: the runner sends those")
    timeout = value.get("request_timeout_seconds", DEFAULT_REQUEST_TIMEOUT_SECONDS)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_REQUEST_TIMEOUT_SECONDS
    ):
        problems.append("policy.request_timeout_seconds must be a number within (0, 600]")
        timeout = DEFAULT_REQUEST_TIMEOUT_SECONDS
    retries = value.get("max_retries", DEFAULT_MAX_RETRIES)
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        problems.append("policy.max_retries must be an integer within 0..10")
        retries = DEFAULT_MAX_RETRIES
    lag = value.get("max_policy_lag")
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
        problems.append("policy.max_policy_lag must be an integer >= 0 (versions), or null")
        lag = None
    trainer = value.get("trainer", DEFAULT_TRAINER)
    if not isinstance(trainer, str) or not _TRAINER.match(trainer):
        problems.append("policy.trainer must be 1-64 letters, digits, '_', '.' or '-'")
        trainer = DEFAULT_TRAINER
    tokens = value.get("tokens", True)
    if not isinstance(tokens, bool):
        problems.append("policy.tokens must be true (ask for token ids) or false")
        tokens = True
    if not usable:
        return None
    return PolicyEndpoint(
        url=str(url).rstrip("/"),
        model=model,
        sampling=dict(sampling),
        request_timeout_seconds=timeout,
        max_retries=retries,
        max_policy_lag=lag,
        trainer=trainer,
        tokens=tokens,
    )
