"""slime: a rollout function for `--rollout-function-path`, written against THUDM/slime at
624b824 (2026-08-21): `generate_rollout(args, rollout_id, data_source, evaluation=False) ->
RolloutFnTrainOutput(samples: list[list[Sample]])` (slime/rollout/base_types.py), `Sample`
from slime/utils/types.py.

slime's data source hands out groups of `Sample`s (one group per prompt, one Sample per
sample); each names its task in `metadata["task_id"]`. The rollout function submits those
tasks x the group size to the service and fills every Sample from its episode's token view:
`tokens` (prompt + response ids), `response_length`, `loss_mask` (the view's mask),
`rollout_log_probs`, `weight_versions` (each model turn's), `reward`, `status` COMPLETED. An
episode that is no sample (an infrastructure failure, lost, aborted) is `status` ABORTED with
`remove_sample` set, reward None: slime drops it rather than scoring it. A stepwise episode
gives its last turn.

slime is imported only by `make_rollout_function`; `fill_sample` works on any object with
those attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainer_stub.adapters.samples import TrainingSample, last_turn, run_episodes
from trainer_stub.client import RolloutClient


def fill_sample(target: Any, sample: TrainingSample | None, status: Any) -> Any:
    """Set a slime Sample's fields from an episode; `status` is slime's Sample.Status."""
    if sample is None or not sample.usable:
        target.reward = None
        target.status = status.ABORTED
        target.remove_sample = True
        return target
    target.tokens = sample.prompt_ids + sample.response_ids
    target.response_length = len(sample.response_ids)
    target.loss_mask = list(sample.response_mask)
    target.rollout_log_probs = list(sample.response_logprobs)
    target.weight_versions = [str(v) for v in sample.policy_versions]
    target.reward = sample.reward
    target.status = status.COMPLETED
    target.remove_sample = False
    return target


def run_groups(
    client: RolloutClient,
    request: Mapping[str, Any],
    groups: list[list[Any]],
    status: Any,
    timeout: float = 900.0,
) -> list[list[Any]]:
    """Fill slime's groups (each a task's Samples, its id in metadata["task_id"]) from one
    batch of those tasks x the largest group."""
    tasks = {str(t["id"]): t for t in request["tasks"]}
    order = [str(group[0].metadata["task_id"]) for group in groups]
    unknown = sorted(set(order) - set(tasks))
    if unknown:
        raise ValueError(f"samples name tasks {unknown[:3]} that this request has not")
    _, found = run_episodes(client, request, order, max(len(group) for group in groups), timeout)
    episodes = {key: last_turn(samples) for key, samples in found.items()}
    for task, group in zip(order, groups, strict=True):
        for number, target in enumerate(group):
            fill_sample(target, episodes.get((task, number)), status)
    return groups


def make_rollout_function(
    client: RolloutClient, request: Mapping[str, Any], timeout: float = 900.0
) -> Callable[..., Any]:
    """slime's `generate_rollout` over the service (training only: evaluation uses slime's
    own). Point `--rollout-function-path` at a module attribute holding it."""
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.types import Sample

    def generate_rollout(
        args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
    ) -> Any:
        if evaluation:
            raise ValueError("the service's rollout function is for training rollouts")
        groups = data_source.get_samples(args.rollout_batch_size)
        return RolloutFnTrainOutput(
            samples=run_groups(client, request, groups, Sample.Status, timeout)
        )

    return generate_rollout
