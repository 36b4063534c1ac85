"""SkyRL: a `GeneratorInterface` whose episodes run in the service, written against SkyRL's
`skyrl/train/generators/base.py` (NovaSky-AI/SkyRL at a956457, 2026-08-21) and tested against
the released `skyrl==0.3.0` (tests/integration/test_trainer_libraries.py, hack/trainer-libs.sh):
`generate(GeneratorInput) -> GeneratorOutput`, outputs in the input's order.

Each input row names its task in `env_extras[i]["task_id"]` and its sample in
`trajectory_ids[i].repetition_id` (SkyRL's GRPO repetitions); `generate` submits one batch of
those tasks x the largest repetition count and maps each episode's token view in:
`prompt_token_ids`, `response_ids`, `loss_masks` (the view's mask), `rollout_logprobs`,
`rewards`, `stop_reasons`, `trajectory_ids`. With `step_wise=True` a stepwise episode gives one
row per turn with `is_last_step` (the reward on the last row, 0.0 on the others: SkyRL carries
the last step's advantage back); otherwise its last turn, and `is_last_step` is None. SkyRL has
no unscored sample, so an episode that is no sample (an infrastructure failure, lost, aborted)
gets one placeholder id with loss mask 0 and its group's mean reward of the valid samples
(advantage 0; the mean stays what the real samples make it), and `stop_reasons` says
`no_sample`. SkyRL 0.3.0's GeneratorOutput is a total TypedDict: every key it declares is
given, None where the service has nothing (generation times, expert indices, env metrics,
vision inputs).

SkyRL is imported only by `skyrl_generator` (a real `GeneratorInterface` subclass); the output
is a plain dict with the TypedDict's keys. (skyrl 0.3.0 does not import on Python 3.11 as
released: `skyrl/tinker/types.py` puts a `typing.TypedDict` in a pydantic model, which pydantic
refuses before 3.12; `skyrl_generator` makes `typing.TypedDict` typing_extensions' for the
import when it has to.)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from trainer_stub.adapters.samples import TrainingSample, run_episodes
from trainer_stub.client import RolloutClient


class SkyRLGenerator:
    """SkyRL's generator over the service (see the module's text)."""

    def __init__(
        self,
        client: RolloutClient,
        request: Mapping[str, Any],
        *,
        step_wise: bool = False,
        timeout: float = 900.0,
        placeholder_id: int = 0,
    ) -> None:
        self.client = client
        self.tasks = {str(t["id"]): t for t in request["tasks"]}
        self.request = request
        self.step_wise = step_wise
        self.timeout = timeout
        self.placeholder_id = placeholder_id

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        keys = batch_keys(input_batch)
        order = list(dict.fromkeys(task for task, _ in keys))
        unknown = sorted(set(order) - set(self.tasks))
        if unknown:
            raise ValueError(f"env_extras name tasks {unknown[:3]} that this request has not")
        samples = 1 + max(sample for _, sample in keys)
        _, episodes = run_episodes(self.client, self.request, order, samples, self.timeout)
        return generator_output(
            keys, episodes, input_batch.get("trajectory_ids"), self.step_wise, self.placeholder_id
        )


def batch_keys(input_batch: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(task id, sample) per input row: env_extras' task_id, trajectory_ids' repetition_id
    (else the row's count among the rows of its task)."""
    extras = input_batch.get("env_extras") or []
    ids = input_batch.get("trajectory_ids") or []
    prompts = input_batch.get("prompts") or []
    if len(extras) != len(prompts):
        raise ValueError("every input row needs env_extras with its task_id")
    keys: list[tuple[str, int]] = []
    seen: dict[str, int] = {}
    for number, extra in enumerate(extras):
        task = str((extra or {}).get("task_id", ""))
        if not task:
            raise ValueError(f"input row {number} has no env_extras task_id")
        repetition = getattr(ids[number], "repetition_id", None) if number < len(ids) else None
        sample = int(repetition) if repetition is not None else seen.get(task, 0)
        seen[task] = sample + 1
        keys.append((task, sample))
    return keys


def generator_output(
    keys: Sequence[tuple[str, int]],
    episodes: Mapping[tuple[str, int], list[TrainingSample]],
    trajectory_ids: Sequence[Any] | None,
    step_wise: bool,
    placeholder_id: int,
) -> dict[str, Any]:
    """SkyRL's GeneratorOutput for the rows `keys`, in their order."""
    means: dict[str, float] = {}
    for task in {task for task, _ in keys}:
        valid = [
            found[-1].reward
            for (t, _), found in episodes.items()
            if t == task and found[-1].reward is not None
        ]
        means[task] = statistics.fmean(valid) if valid else 0.0
    out: dict[str, Any] = {
        "prompt_token_ids": [],
        "response_ids": [],
        "rewards": [],
        "loss_masks": [],
        "stop_reasons": [],
        "rollout_logprobs": [],
        "trajectory_ids": [],
        "rollout_metrics": None,
        # SkyRL 0.3.0 declares these too (total TypedDict); the service has none of them.
        "trajectory_generation_times": None,
        "rollout_expert_indices": None,
        "is_last_step": None,
        "env_metrics": None,
        "pixel_values": None,
        "image_grid_thw": None,
    }
    last_steps: list[bool] = []
    for number, key in enumerate(keys):
        found = episodes.get(key) or []
        usable = [s for s in found if s.usable]
        rows = usable if step_wise else usable[-1:]
        ident = trajectory_ids[number] if trajectory_ids and number < len(trajectory_ids) else None
        if not rows:
            out["prompt_token_ids"].append([placeholder_id])
            out["response_ids"].append([placeholder_id])
            out["loss_masks"].append([0])
            out["rollout_logprobs"].append([0.0])
            out["rewards"].append(means[key[0]])
            out["stop_reasons"].append("no_sample")
            out["trajectory_ids"].append(ident)
            last_steps.append(True)
            continue
        for position, sample in enumerate(rows):
            last = position == len(rows) - 1
            out["prompt_token_ids"].append(sample.prompt_ids)
            out["response_ids"].append(sample.response_ids)
            out["loss_masks"].append(sample.response_mask)
            out["rollout_logprobs"].append(sample.response_logprobs)
            out["rewards"].append(sample.reward if last else 0.0)
            out["stop_reasons"].append("stop")
            out["trajectory_ids"].append(ident)
            last_steps.append(last)
    if step_wise:
        out["is_last_step"] = last_steps
    return out


def skyrl_generator(
    client: RolloutClient,
    request: Mapping[str, Any],
    *,
    step_wise: bool = False,
    timeout: float = 900.0,
    placeholder_id: int = 0,
) -> Any:
    """A real SkyRL `GeneratorInterface` (imports skyrl) over the service: pass it to SkyRL's
    trainer as its generator."""
    import typing

    try:
        from skyrl.train.generators.base import GeneratorInterface
    except Exception as error:  # skyrl 0.3.0 on Python < 3.12
        if "typing_extensions.TypedDict" not in str(error):
            raise
        import typing_extensions

        real = typing.TypedDict
        typing.TypedDict = typing_extensions.TypedDict
        try:
            from skyrl.train.generators.base import GeneratorInterface
        finally:
            typing.TypedDict = real

    class ServiceGenerator(SkyRLGenerator, GeneratorInterface):
        """SkyRLGenerator as SkyRL's GeneratorInterface."""

    return ServiceGenerator(
        client, request, step_wise=step_wise, timeout=timeout, placeholder_id=placeholder_id
    )
