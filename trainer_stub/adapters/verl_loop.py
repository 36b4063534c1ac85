"""verl: an agent loop whose episode runs in the service, written against
verl/experimental/agent_loop/agent_loop.py (volcengine/verl at b178a3c, 2026-01-29):
`@register(name)` on an `AgentLoopBase` subclass, `async run(sampling_params, **kwargs) ->
AgentLoopOutput(prompt_ids, response_ids, response_mask, response_logprobs, reward_score,
num_turns, metrics, extra_fields)`.

verl runs one loop per sample: `run` submits that one episode (its task from the dataset row's
`extra_info["task_id"]`, or a `task_id` column) and waits for its row off the event loop. The
token view maps in as verl wants it: the sequence's prompt and response ids, the mask (1 for
the model's ids, 0 for the environment's), log-probabilities, and the sandboxed tests' reward
as `reward_score`, so verl's reward manager is not asked. A stepwise episode gives its last
turn. verl has no unscored sample: an episode that is no sample gets one placeholder id with
mask 0, `reward_score` None and `extra_fields["no_sample"]` with the cause; a trainer must drop
such rows before its advantages (not done here). One batch per episode is simple, not cheap:
batching verl's concurrent loops into one batch per step is not built.

verl is imported only by `register_agent_loop`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from trainer_stub.adapters.samples import TrainingSample, last_turn, run_episodes
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


def run_episode(
    client: RolloutClient, request: Mapping[str, Any], task_id: str, timeout: float = 900.0
) -> TrainingSample:
    """One episode of `task_id`, submitted and waited for: its training sample."""
    tasks = {str(t["id"]): t for t in request["tasks"]}
    if task_id not in tasks:
        raise ValueError(f"task {task_id!r} is not in this request")
    batch_id, found = run_episodes(client, request, [task_id], 1, timeout)
    if (task_id, 0) not in found:
        raise RuntimeError(f"batch {batch_id} ended without its episode's row")
    return last_turn(found[(task_id, 0)])


def register_agent_loop(
    name: str, client: RolloutClient, request: Mapping[str, Any], timeout: float = 900.0
) -> type:
    """Register a verl agent loop `name` that runs each sample as an episode of the service."""
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )

    @register(name)
    class ServiceAgentLoop(AgentLoopBase):
        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            task_id = str((kwargs.get("extra_info") or {}).get("task_id") or kwargs["task_id"])
            sample = await asyncio.to_thread(run_episode, client, request, task_id, timeout)
            return AgentLoopOutput(**agent_loop_fields(sample), metrics=AgentLoopMetrics())

    return ServiceAgentLoop
