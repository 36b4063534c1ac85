"""The adapters' common mapping: an episode row with its token view becomes training samples
(one sequence, one per turn for a stepwise episode, none with the reason for an episode that
is no sample), and TRL's rollout_func fields line up with the prompts TRL asked for."""

from __future__ import annotations

import pytest

from trainer_stub.adapters.samples import samples_of_row
from trainer_stub.adapters.trl_rollout import TRLRollouts, rollout_fields, rollout_reward

SEQUENCE = {
    "tokens": "available",
    "layout": "sequence",
    "prefix_broke_at": None,
    "prompt_ids": [1, 4, 20, 2, 1, 5],
    "response_ids": [30, 31, 2, 1, 6, 40, 2, 1, 5, 32, 2],
    "response_mask": [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1],
    "response_logprobs": [-0.1, -0.2, -0.3, 0, 0, 0, 0, 0, 0, -0.4, -0.5],
    "turns": [
        {"start": 0, "end": 3, "policy_version": "4"},
        {"start": 9, "end": 11, "policy_version": "5"},
    ],
}
STEPWISE = {
    "tokens": "available",
    "layout": "stepwise",
    "prefix_broke_at": 2,
    "samples": [
        {
            "prompt_ids": [1, 4],
            "response_ids": [7, 2],
            "response_mask": [1, 1],
            "response_logprobs": [-1.0, -0.5],
            "policy_version": "4",
        },
        {
            "prompt_ids": [1, 4, 9],
            "response_ids": [8, 2],
            "response_mask": [1, 1],
            "response_logprobs": [-0.7, -0.1],
            "policy_version": "4",
        },
    ],
}


def row(task="t", sample=0, status="ok", reward=0.5, tokens=SEQUENCE, **extra):
    return {
        "task_id": task,
        "sample": sample,
        "index": sample,
        "status": status,
        "reward": reward,
        "tokens": tokens,
        **extra,
    }


def test_a_sequence_episode_is_one_sample_with_its_mask_and_versions():
    (sample,) = samples_of_row(row())
    assert sample.usable and sample.reward == 0.5 and sample.turns == 2
    assert sample.response_ids == SEQUENCE["response_ids"]
    assert sample.response_mask == SEQUENCE["response_mask"]
    assert sample.policy_versions == ["4", "5"]


def test_a_stepwise_episode_is_one_sample_per_turn_each_with_the_reward():
    first, second = samples_of_row(row(tokens=STEPWISE, reward=1.0))
    assert (first.turn, second.turn) == (1, 2)
    assert second.prompt_ids == [1, 4, 9] and second.reward == first.reward == 1.0


@pytest.mark.parametrize(
    ("changes", "aborted", "why"),
    [
        ({"status": "failed", "failure_cause": "node lost"}, False, "node lost"),
        ({"status": "aborted"}, True, "aborted"),
        ({"tokens": {"tokens": "unavailable", "reason": "turn 1: no ids"}}, False, "no ids"),
        ({"tokens": None}, False, "no token view"),
    ],
)
def test_an_episode_that_is_no_sample_has_no_reward_never_a_zero(changes, aborted, why):
    (sample,) = samples_of_row(row() | changes)
    assert sample.reward is None and not sample.usable
    assert sample.aborted is aborted and why in str(sample.missing)


def test_trl_fields_follow_the_prompts_kth_occurrence_is_sample_k():
    episodes = {
        ("a", 0): samples_of_row(row("a", 0, reward=1.0))[0],
        ("a", 1): samples_of_row(row("a", 1, status="failed"))[0],
        ("b", 0): samples_of_row(row("b", 0, tokens=STEPWISE, reward=0.0))[-1],
    }
    out = rollout_fields(["a", "a", "b", "b"], episodes, placeholder_id=99)
    assert out["rollout_reward"] == [1.0, None, 0.0, None]
    assert out["rollout_status"] == ["ok", "failed", "ok", "missing"]
    assert out["completion_ids"][0] == SEQUENCE["response_ids"]
    assert out["env_mask"][0] == SEQUENCE["response_mask"]
    # No sample: one placeholder id, masked out.
    assert out["completion_ids"][1] == [99] and out["env_mask"][1] == [0]
    assert out["prompt_ids"][2] == [1, 4, 9]  # a stepwise episode's last turn
    assert all(
        len(ids) == len(lp) == len(mask)
        for ids, lp, mask in zip(
            out["completion_ids"], out["logprobs"], out["env_mask"], strict=True
        )
    )
    assert rollout_reward([], [], out["rollout_reward"]) == [1.0, None, 0.0, None]


def test_trl_prompts_must_be_task_ids_asked_equally_often():
    rollouts = TRLRollouts(client=None, request={"tasks": [{"id": "a"}, {"id": "b"}]})  # type: ignore[arg-type]
    assert rollouts.dataset(2) == [{"prompt": p} for p in ["a", "b", "a", "b"]]
    with pytest.raises(ValueError, match="no task ids"):
        rollouts(["c"])
    with pytest.raises(ValueError, match="same number of times"):
        rollouts(["a", "a", "b"])


# SkyRL's GeneratorOutput keys (skyrl 0.3.0's skyrl/train/generators/base.py: a total TypedDict,
# every key required; tests/integration/test_trainer_libraries.py checks the real class).
SKYRL_OUTPUT_KEYS = {
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "rollout_expert_indices",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
}


@pytest.mark.parametrize("step_wise", [False, True])
def test_skyrl_output_has_its_documented_keys_and_no_sample_moves_no_baseline(step_wise):
    from trainer_stub.adapters.skyrl_generator import batch_keys, generator_output

    class Trajectory:  # SkyRL's TrajectoryID: instance_id, repetition_id
        def __init__(self, instance, repetition):
            self.instance_id, self.repetition_id = instance, repetition

    ids = [Trajectory("a", 0), Trajectory("a", 1), Trajectory("a", 2), Trajectory("b", 0)]
    batch = {
        "prompts": [[{"role": "user", "content": "x"}]] * 4,
        "env_extras": [{"task_id": "a"}, {"task_id": "a"}, {"task_id": "a"}, {"task_id": "b"}],
        "trajectory_ids": ids,
    }
    keys = batch_keys(batch)
    assert keys == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    episodes = {
        ("a", 0): samples_of_row(row("a", 0, reward=1.0)),
        ("a", 1): samples_of_row(row("a", 1, status="failed")),
        ("a", 2): samples_of_row(row("a", 2, reward=0.0)),
        ("b", 0): samples_of_row(row("b", 0, tokens=STEPWISE, reward=1.0)),
    }
    out = generator_output(keys, episodes, ids, step_wise, placeholder_id=7)
    assert set(out) == SKYRL_OUTPUT_KEYS
    rows = 5 if step_wise else 4
    assert all(len(out[k]) == rows for k in out if isinstance(out[k], list))
    # The failed sample: masked out, rewarded its group's mean, so no advantage and no shift.
    assert out["loss_masks"][1] == [0] and out["rewards"][1] == 0.5
    assert out["stop_reasons"][1] == "no_sample" and out["trajectory_ids"][1] is ids[1]
    if step_wise:
        assert out["is_last_step"] == [True, True, True, False, True]
        assert out["rewards"][3:] == [0.0, 1.0] and out["prompt_token_ids"][3] == [1, 4]
    else:
        assert out["prompt_token_ids"][3] == [1, 4, 9] and out["rewards"][3] == 1.0
        assert out["is_last_step"] is None


def test_slime_samples_are_filled_from_the_token_view_and_no_sample_is_dropped():
    from enum import Enum

    from trainer_stub.adapters.slime_rollout import fill_sample

    class Status(Enum):  # slime's Sample.Status (slime/utils/types.py at 624b824)
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    class Sample:  # the fields slime's Sample has, at their defaults
        def __init__(self):
            self.tokens, self.response_length, self.loss_mask = [], 0, None
            self.rollout_log_probs, self.weight_versions, self.reward = None, [], None
            self.status, self.remove_sample, self.metadata = Status.PENDING, False, {}

    done = fill_sample(Sample(), samples_of_row(row(reward=1.0))[0], Status)
    assert done.tokens == SEQUENCE["prompt_ids"] + SEQUENCE["response_ids"]
    assert done.response_length == len(done.loss_mask) == len(done.rollout_log_probs) == 11
    assert (done.weight_versions, done.reward, done.status) == (["4", "5"], 1.0, Status.COMPLETED)
    lost = fill_sample(Sample(), samples_of_row(row(status="failed"))[0], Status)
    assert (lost.status, lost.remove_sample, lost.reward) == (Status.ABORTED, True, None)


# verl's AgentLoopOutput fields (verl 0.9.1's verl/experimental/agent_loop/agent_loop.py; the
# real pydantic model is checked in tests/integration/test_trainer_libraries.py).
VERL_OUTPUT_FIELDS = {
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "routed_experts",
    "multi_modal_data",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
    "mm_processor_kwargs",
    "mm_processor_output",
}


def test_verl_output_carries_the_view_and_the_sandboxed_reward():
    from trainer_stub.adapters.verl_loop import agent_loop_fields

    fields = agent_loop_fields(samples_of_row(row(reward=0.75))[0])
    assert set(fields) | {"metrics"} <= VERL_OUTPUT_FIELDS
    assert fields["response_mask"] == SEQUENCE["response_mask"]
    assert (fields["reward_score"], fields["num_turns"]) == (0.75, 4)
    lost = agent_loop_fields(samples_of_row(row(status="failed", failure_cause="oom"))[0])
    assert lost["reward_score"] is None and lost["response_mask"] == [0]
    assert lost["extra_fields"]["no_sample"] is True and lost["extra_fields"]["cause"] == "oom"


# -- many loops asking one episode each: one batch -----------------------------------------------
class GroupsClient:
    """A service stand-in: each submission's groups complete in task order, each group's rows
    made from (task, sample); `hold` keeps a task's group back until released."""

    def __init__(self, hold: str | None = None):
        import threading

        self.submitted: list[dict] = []
        self.hold, self.released = hold, threading.Event()

    def submit(self, **fields):
        from types import SimpleNamespace

        self.submitted.append(fields)
        return SimpleNamespace(batch_id=f"b{len(self.submitted)}")

    def sampled_groups(self, batch_id, timeout):
        fields = self.submitted[int(batch_id[1:]) - 1]
        for task in fields["tasks"]:
            if task["id"] == self.hold:
                assert self.released.wait(10)
            n = fields["samples_per_task"]
            yield task, [row(task["id"], s, reward=s / 10) for s in range(n)]


REQUEST = {"tasks": [{"id": "a"}, {"id": "b"}, {"id": "c"}], "policy": {"url": "http://x"}}


def test_concurrent_asks_are_one_batch_per_sample_count_and_each_gets_its_own_episode():
    import asyncio

    from trainer_stub.adapters.batching import EpisodeBatcher

    client = GroupsClient()
    batcher = EpisodeBatcher(client, REQUEST, timeout=5, window=0.05)

    async def step():
        asks = ["a"] * 4 + ["b"] * 4 + ["c"] * 2
        return await asyncio.gather(*(batcher.episode(t) for t in asks))

    samples = asyncio.run(step())
    # GRPO's shape (4 each) is one batch; the task asked twice is a batch of its own.
    shapes = sorted(
        ([t["id"] for t in f["tasks"]], f["samples_per_task"]) for f in client.submitted
    )
    assert shapes == [(["a", "b"], 4), (["c"], 2)]
    assert client.submitted[0]["policy"] == REQUEST["policy"]
    got = [(s.task_id, s.sample) for s in samples]
    assert got == [("a", k) for k in range(4)] + [("b", k) for k in range(4)] + [
        ("c", 0),
        ("c", 1),
    ]


def test_an_ask_is_answered_when_its_group_completes_not_when_the_batch_does():
    import asyncio

    from trainer_stub.adapters.batching import EpisodeBatcher

    client = GroupsClient(hold="b")
    batcher = EpisodeBatcher(client, REQUEST, timeout=5, window=0.01)

    async def step():
        fast = asyncio.ensure_future(batcher.episode("a"))
        slow = asyncio.ensure_future(batcher.episode("b"))  # its group comes after a's
        fast = await asyncio.wait_for(fast, timeout=5)
        assert not slow.done()  # b's group is still held back
        client.released.set()
        return fast, await asyncio.wait_for(slow, timeout=5)

    fast, slow = asyncio.run(step())
    assert (fast.task_id, slow.task_id) == ("a", "b")
    assert len(client.submitted) == 1


def test_an_unknown_task_or_a_failed_batch_is_an_error_for_each_of_its_asks():
    import asyncio

    from trainer_stub.adapters.batching import EpisodeBatcher

    class Broken(GroupsClient):
        def sampled_groups(self, batch_id, timeout):
            raise TimeoutError("the batch took too long")
            yield

    async def ask(batcher, task):
        return await batcher.episode(task)

    with pytest.raises(ValueError, match="not in this request"):
        asyncio.run(ask(EpisodeBatcher(GroupsClient(), REQUEST), "zzz"))
    with pytest.raises(TimeoutError, match="too long"):
        asyncio.run(ask(EpisodeBatcher(Broken(), REQUEST, window=0.01), "a"))


def test_a_step_asking_fewer_episodes_than_the_request_parallelism_runs_them_all():
    # A trainer's request names its parallelism for full steps; a step of 2 tasks x 2 samples
    # must still be a valid batch (parse_spec refuses parallelism above the count).
    from trainer_stub.adapters.samples import submit_episodes

    client = GroupsClient()
    submit_episodes(client, REQUEST | {"parallelism": 8}, ["b", "a"], 2)
    submit_episodes(client, REQUEST | {"parallelism": 3}, ["a", "b", "c"], 4)
    submit_episodes(client, REQUEST, ["c"], 1)
    assert [f.get("parallelism") for f in client.submitted] == [4, 3, None]
    assert [t["id"] for t in client.submitted[0]["tasks"]] == ["b", "a"]
