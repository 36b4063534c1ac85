"""verl: an agent loop whose episode runs in the service, written against
verl/experimental/agent_loop/agent_loop.py (volcengine/verl at b178a3c, 2026-01-29) and
tested against the released `verl==0.9.1` (tests/integration/test_trainer_libraries.py,
hack/trainer-libs.sh): `@register(name)` on an `AgentLoopBase` subclass, `async
run(sampling_params, **kwargs) -> AgentLoopOutput(prompt_ids, response_ids, response_mask,
response_logprobs, reward_score, num_turns, metrics, extra_fields)` (a pydantic model;
`metrics` an `AgentLoopMetrics`, required).

verl runs one loop per sample: `run` asks for that one episode (its task from the dataset row's
`extra_info["task_id"]`, or a `task_id` column) and awaits its row; the asks of a process's
loops that arrive together go out as one batch (`EpisodeBatcher`: one submission for a step's
prompts x samples, each loop answered as its task's group completes). The
token view maps in as verl wants it: the sequence's prompt and response ids, the mask (1 for
the model's ids, 0 for the environment's), log-probabilities, and the sandboxed tests' reward
as `reward_score`, so verl's reward manager is not asked. A stepwise episode gives its last
turn. verl has no unscored sample: an episode that is no sample gets one placeholder id with
mask 0, `reward_score` None and `extra_fields["no_sample"]` with the cause; a trainer must drop
such rows before its advantages (not done here).

verl's `register` records the class by its import path (`{"_target_": module.qualname}`) and
its workers build each loop with `hydra.utils.instantiate` (in Ray worker processes), so the
loop is this module's `ServiceAgentLoop`, made on first access (verl is imported then, not
before). Its service is the constructor's `redis_url` and `request_path` (a JSON file; e.g.
extra keys of an entry in verl's `agent_loop_config_path`) or, in the process that called
`register_agent_loop`, the client and request given there (one service per process).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from trainer_stub.adapters.batching import EpisodeBatcher
from trainer_stub.adapters.samples import TrainingSample
from trainer_stub.client import RolloutClient


def agent_loop_fields(sample: TrainingSample, placeholder_id: int = 0) -> dict[str, Any]:
    """AgentLoopOutput's fields (but `metrics`) for one episode."""
    if not sample.usable:
        return {
            "prompt_ids": [placeholder_id],
            "response_ids": [placeholder_id],
            "response_mask": [0],
            "response_logprobs": [0.0],
            "reward_score": None,
            "num_turns": 0,
            "extra_fields": {"no_sample": True, "cause": sample.missing, "status": sample.status},
        }
    return {
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "response_mask": sample.response_mask,
        "response_logprobs": sample.response_logprobs,
        "reward_score": sample.reward,
        # verl counts every message; the view knows the model's turns: 2 per turn is a floor.
        "num_turns": 2 * sample.turns,
        "extra_fields": {"policy_versions": sample.policy_versions, "episode": sample.episode_id},
    }


# The service `register_agent_loop` gave this process: (client, request, timeout).
_service: tuple[RolloutClient, Mapping[str, Any], float] | None = None
_loop_class: type | None = None


def register_agent_loop(
    name: str, client: RolloutClient, request: Mapping[str, Any], timeout: float = 900.0
) -> type:
    """Register `ServiceAgentLoop` with verl as `name`, running each sample as an episode of
    the service `client` serves with `request` (this process's service from now on)."""
    from verl.experimental.agent_loop.agent_loop import register

    global _service
    _service = (client, request, timeout)
    cls = service_agent_loop()
    register(name)(cls)
    return cls


def service_agent_loop() -> type:
    """verl's `AgentLoopBase` subclass over the service (imports verl on first call)."""
    global _loop_class
    if _loop_class is not None:
        return _loop_class
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
    )

    class ServiceAgentLoop(AgentLoopBase):
        """Each sample an episode of the service (see trainer_stub.adapters.verl_loop)."""

        def __init__(
            self,
            *args: Any,
            redis_url: str | None = None,
            request_path: str | None = None,
            timeout: float | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            self.service = service_of(redis_url, request_path, timeout)

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            task_id = str((kwargs.get("extra_info") or {}).get("task_id") or kwargs["task_id"])
            sample = await batcher_of(self.service).episode(task_id)
            return AgentLoopOutput(**agent_loop_fields(sample), metrics=AgentLoopMetrics())

    ServiceAgentLoop.__module__ = __name__
    ServiceAgentLoop.__qualname__ = "ServiceAgentLoop"
    _loop_class = ServiceAgentLoop
    return ServiceAgentLoop


# One batcher per service (client and request) in this process: every loop of a worker shares it.
_batchers: dict[tuple[int, int], EpisodeBatcher] = {}
_batchers_lock = threading.Lock()
_configured: dict[
    tuple[str, str, float | None], tuple[RolloutClient, Mapping[str, Any], float]
] = {}


def batcher_of(service: tuple[RolloutClient, Mapping[str, Any], float]) -> EpisodeBatcher:
    client, request, wait = service
    with _batchers_lock:
        key = (id(client), id(request))
        if key not in _batchers:
            _batchers[key] = EpisodeBatcher(client, request, wait)
        return _batchers[key]


def service_of(
    redis_url: str | None, request_path: str | None, timeout: float | None
) -> tuple[RolloutClient, Mapping[str, Any], float]:
    """The loop's service: from its config's keys, else the one this process registered."""
    if redis_url and request_path:
        # Made once per process and config: the loops verl makes share it (and its batcher).
        key = (redis_url, request_path, timeout)
        with _batchers_lock:
            if key not in _configured:
                with open(request_path, encoding="utf-8") as handle:
                    request = json.load(handle)
                wait = 900.0 if timeout is None else float(timeout)
                _configured[key] = (RolloutClient(redis_url), request, wait)
            return _configured[key]
    if _service is None:
        raise RuntimeError(
            "ServiceAgentLoop has no service: give redis_url and request_path in its agent loop "
            "config, or call register_agent_loop in this process"
        )
    client, request, wait = _service
    return client, request, wait if timeout is None else float(timeout)


def __getattr__(name: str) -> Any:
    # verl's workers find the registered loop by its path: this module's ServiceAgentLoop.
    if name == "ServiceAgentLoop":
        return service_agent_loop()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
