"""TRL: `GRPOTrainer(rollout_func=TRLRollouts(...))`, checked against TRL 1.16.

TRL hands `rollout_func(prompts, trainer)` the generation batch's prompts, each already
repeated `num_generations` times in a row, and wants one completion per prompt entry:
`prompt_ids`, `completion_ids`, `logprobs` (lists per completion), optionally `env_mask` (1 for
the model's ids, 0 for tool and environment ids); every other key reaches the reward functions
as a keyword argument, one value per completion. Here the dataset's prompt is a task id
(`dataset()`): each call submits one batch of those tasks x the repeat count to the workers,
waits for its groups, and maps each episode's token view in. The reward is the sandboxed
tests' (`rollout_reward`, the reward function to pass); an episode that is no sample (an
infrastructure failure, lost, aborted) gets reward None, which TRL leaves out of its group's
baseline (its advantage is 0), and a one-id placeholder masked out. A stepwise episode gives
its last turn. `PublishVersions` is the callback that tells the service (and an in-process
engine) each new policy version after an optimizer step, so the batch's staleness bound
applies to the next batch.

TRL and transformers are imported only by `publish_versions`; the mapping itself needs neither.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer_stub.adapters.samples import TrainingSample, last_turn, run_episodes
from trainer_stub.client import RolloutClient


@dataclass
class BatchTiming:
    """Where one rollout_func call's time went."""

    batch_id: str
    episodes: int
    seconds: float
    rewards: list[float | None] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)


class TRLRollouts:
    """TRL's `rollout_func` over the service (see the module's text)."""

    def __init__(
        self,
        client: RolloutClient,
        request: Mapping[str, Any],
        *,
        timeout: float = 900.0,
        placeholder_id: int = 0,
    ) -> None:
        tasks = request.get("tasks")
        if not isinstance(tasks, list) or not tasks:
            raise ValueError("the request needs its tasks: the dataset's prompts are their ids")
        self.client = client
        self.request = request
        self.tasks = {str(t["id"]): t for t in tasks}
        self.timeout = timeout
        self.placeholder_id = placeholder_id
        self.batches: list[BatchTiming] = []

    def dataset(self, repeats: int = 1) -> list[dict[str, str]]:
        """The training dataset: one row per task (`repeats` times), its prompt the task id."""
        return [{"prompt": task_id} for _ in range(repeats) for task_id in self.tasks]

    def __call__(self, prompts: Sequence[Any], trainer: Any = None) -> dict[str, list[Any]]:
        order = [str(p) for p in prompts]
        unknown = sorted(set(order) - set(self.tasks))
        if unknown:
            raise ValueError(f"prompts {unknown[:3]} are no task ids of this request")
        counts = Counter(order)
        if len(set(counts.values())) != 1:
            raise ValueError(f"every task must be asked the same number of times, got {counts}")
        started = time.monotonic()
        batch_id, found = run_episodes(
            self.client, self.request, order, next(iter(counts.values())), self.timeout
        )
        episodes = {key: last_turn(samples) for key, samples in found.items()}
        out = rollout_fields(order, episodes, self.placeholder_id)
        self.batches.append(
            BatchTiming(
                batch_id,
                len(order),
                time.monotonic() - started,
                list(out["rollout_reward"]),
                list(out["rollout_status"]),
            )
        )
        return out


def rollout_fields(
    order: Sequence[str], episodes: Mapping[tuple[str, int], TrainingSample], placeholder_id: int
) -> dict[str, list[Any]]:
    """TRL's output dict for prompts `order` (task ids, each repeated per sample): the k-th
    occurrence of a task is its sample k."""
    out: dict[str, list[Any]] = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        "rollout_reward": [],
        "rollout_status": [],
        "policy_versions": [],
    }
    seen: Counter[str] = Counter()
    for task_id in order:
        number = seen[task_id]
        seen[task_id] += 1
        sample = episodes.get((task_id, number))
        if sample is not None and sample.usable:
            out["prompt_ids"].append(sample.prompt_ids)
            out["completion_ids"].append(sample.response_ids)
            out["logprobs"].append(sample.response_logprobs)
            out["env_mask"].append(sample.response_mask)
            out["rollout_reward"].append(sample.reward)
        else:
            # No sample: one id, masked out, unscored (never a 0 reward).
            out["prompt_ids"].append([placeholder_id])
            out["completion_ids"].append([placeholder_id])
            out["logprobs"].append([0.0])
            out["env_mask"].append([0])
            out["rollout_reward"].append(None)
        out["rollout_status"].append(sample.status if sample is not None else "missing")
        out["policy_versions"].append(sample.policy_versions if sample is not None else [])
    return out


def rollout_reward(
    prompts: Sequence[Any], completions: Sequence[Any], rollout_reward: Sequence[Any], **_: Any
) -> list[float | None]:
    """The reward function to give GRPOTrainer: the sandboxed tests' reward of each episode."""
    return [None if r is None else float(r) for r in rollout_reward]


def publish_versions(
    client: RolloutClient,
    *,
    trainer_name: str = "default",
    on_version: Callable[[int], None] | None = None,
) -> Any:
    """A transformers `TrainerCallback` that, after each optimizer step, publishes the new
    policy version (the global step) to the service and to `on_version` (an engine that serves
    the policy: it must tag its answers with the version)."""
    from transformers import TrainerCallback

    class PublishVersions(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            version = int(state.global_step)
            if on_version is not None:
                on_version(version)
            client.publish_policy_version(version, trainer_name)

    return PublishVersions()
