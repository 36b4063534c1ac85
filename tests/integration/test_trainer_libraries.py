"""The verl and SkyRL adapters against the released libraries' own classes (verl 0.9.1, skyrl
0.3.0, installed beside the venv by hack/trainer-libs.sh, which the fixture runs: a second run
is instant). Each check runs in a subprocess with the library's folder first on PYTHONPATH and
the venv's torch and transformers; a library that does not import fails the test, never skips
it.

verl: the adapter's fields build the real pydantic `AgentLoopOutput` (strict validation, with
the required `AgentLoopMetrics`) for a sequence, a stepwise and a no-sample episode; the loop
registered with the real `register` is found by hydra from its recorded path, in this process
and in a fresh one (as verl's Ray workers do), is built by `hydra.utils.instantiate` with the
arguments verl's worker passes, and its `run` returns what `AgentLoopOutput.as_dict` takes.

SkyRL: the adapter's output has exactly the keys of the real `GeneratorOutput` TypedDict, each
value of its declared type, and passes SkyRL's own `validate_generator_output` (step-wise too);
the real `GeneratorInput` is read; `skyrl_generator` is a concrete `GeneratorInterface` whose
`generate` has the interface's signature.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.train]

ROOT = Path(__file__).resolve().parents[2]

# Rows as trainer_stub's client gives them, with a fake client that answers one batch.
COMMON = textwrap.dedent(
    """
    import asyncio, inspect, json, typing
    from types import SimpleNamespace

    SEQUENCE = {
        "tokens": "available", "layout": "sequence", "prefix_broke_at": None,
        "prompt_ids": [1, 4, 20, 2, 1, 5],
        "response_ids": [30, 31, 2, 1, 6, 40, 2, 1, 5, 32, 2],
        "response_mask": [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1],
        "response_logprobs": [-0.1, -0.2, -0.3, 0, 0, 0, 0, 0, 0, -0.4, -0.5],
        "turns": [{"start": 0, "end": 3, "policy_version": "4"},
                  {"start": 9, "end": 11, "policy_version": "5"}],
    }
    STEPWISE = {
        "tokens": "available", "layout": "stepwise", "prefix_broke_at": 2,
        "samples": [
            {"prompt_ids": [1, 4], "response_ids": [7, 2], "response_mask": [1, 1],
             "response_logprobs": [-1.0, -0.5], "policy_version": "4"},
            {"prompt_ids": [1, 4, 9], "response_ids": [8, 2], "response_mask": [1, 1],
             "response_logprobs": [-0.7, -0.1], "policy_version": "4"},
        ],
    }

    def row(task="a", sample=0, status="ok", reward=0.5, tokens=SEQUENCE, **extra):
        return {"task_id": task, "sample": sample, "index": sample, "status": status,
                "reward": reward, "tokens": tokens, "pod": f"ep-{task}-{sample}", **extra}

    class FakeClient:
        def __init__(self, rows):
            self.rows, self.submitted = rows, []
        def submit(self, **fields):
            self.submitted.append(fields)
            return SimpleNamespace(batch_id="b1")
        def sampled_groups(self, batch_id, timeout):
            tasks = [t["id"] for t in self.submitted[-1]["tasks"]]
            n = self.submitted[-1]["samples_per_task"]
            for task in tasks:
                yield task, [r for r in self.rows if r["task_id"] == task and r["sample"] < n]

    REQUEST = {"tasks": [{"id": "a"}, {"id": "b"}], "policy": {"base_url": "http://x"}}
    """
)

VERL = textwrap.dedent(
    """
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import agent_loop as real
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, DictConfigWrap, register)
    import verl
    assert verl.__version__ == "0.9.1", verl.__version__
    from trainer_stub.adapters.samples import samples_of_row
    from trainer_stub.adapters import verl_loop

    fields = AgentLoopOutput.model_fields
    required = {n for n, f in fields.items() if f.is_required()}
    assert required == {"prompt_ids", "response_ids", "response_mask", "metrics"}, required
    cases = [samples_of_row(row(reward=0.75))[0], samples_of_row(row(tokens=STEPWISE))[-1],
             samples_of_row(row(status="failed", failure_cause="oom"))[0],
             samples_of_row(row(status="aborted"))[0]]
    for sample in cases:
        mine = verl_loop.agent_loop_fields(sample)
        assert set(mine) <= set(fields) and required <= set(mine) | {"metrics"}, set(mine)
        out = AgentLoopOutput.model_validate(
            {**mine, "metrics": AgentLoopMetrics()}, strict=True)
        tensors = out.as_dict()
        assert tensors["responses"].shape == tensors["response_mask"].shape
        assert tensors["rollout_log_probs"].shape == tensors["responses"].shape
        assert out.reward_score == (sample.reward if sample.usable else None)
    print("verl: AgentLoopOutput takes the adapter's fields, required", sorted(required))

    client = FakeClient([row("a", 0, reward=1.0)])
    cls = verl_loop.register_agent_loop("rollout_service", client, REQUEST, timeout=5)
    target = real._agent_loop_registry["rollout_service"]["_target_"]
    assert target == "trainer_stub.adapters.verl_loop.ServiceAgentLoop", target
    assert hydra.utils.get_class(target) is cls
    assert issubclass(cls, AgentLoopBase) and not inspect.isabstract(cls)
    base, ours = inspect.signature(AgentLoopBase.run), inspect.signature(cls.run)
    assert list(base.parameters) == list(ours.parameters), (base, ours)
    assert inspect.iscoroutinefunction(cls.run)

    # As verl's AgentLoopWorker._run_agent_loop builds it (its config: just what the loop reads).
    from trainer_stub.engine import build_tokenizer
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {}}, "data": {"apply_chat_template_kwargs": {}}})
    loop = hydra.utils.instantiate(
        config=real._agent_loop_registry["rollout_service"],
        trainer_config=DictConfigWrap(config=config), server_manager=None,
        tokenizer=build_tokenizer(), processor=None, hf_model_type=None, dataset_cls=None,
        data_config=DictConfigWrap(config.data), tools=real.ToolListWrap([]))
    assert type(loop) is cls
    out = asyncio.run(loop.run({"temperature": 1.0}, extra_info={"task_id": "a"}, index=0))
    assert isinstance(out, AgentLoopOutput) and out.reward_score == 1.0
    assert out.response_ids == SEQUENCE["response_ids"] and out.num_turns == 4
    assert client.submitted[0]["samples_per_task"] == 1
    print("verl: registered, instantiated by hydra, run ->", out.reward_score)
    """
)

# A fresh process (a Ray worker) finds the loop by its path alone, with its service from the
# agent loop config's keys.
VERL_WORKER = textwrap.dedent(
    """
    import hydra, sys
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase
    cls = hydra.utils.get_class("trainer_stub.adapters.verl_loop.ServiceAgentLoop")
    assert issubclass(cls, AgentLoopBase) and cls.__qualname__ == "ServiceAgentLoop"
    from trainer_stub.adapters import verl_loop
    try:
        verl_loop.service_of(None, None, None)
    except RuntimeError as error:
        assert "redis_url and request_path" in str(error)
    else:
        raise AssertionError("a loop without a service was built")
    # An agent_loop_config_path entry: verl instantiates it with its extra keys.
    import json, os, tempfile
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from trainer_stub.engine import build_tokenizer
    path = os.path.join(tempfile.mkdtemp(), "request.json")
    with open(path, "w") as handle:
        json.dump(REQUEST, handle)
    entry = OmegaConf.create({"name": "rollout_service", "_target_": cls.__module__ + "." +
                              cls.__qualname__, "redis_url": "redis://127.0.0.1:1/0",
                              "request_path": path, "timeout": 30})
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {}}, "data": {"apply_chat_template_kwargs": {}}})
    loop = hydra.utils.instantiate(
        config=entry, trainer_config=DictConfigWrap(config=config), server_manager=None,
        tokenizer=build_tokenizer(), processor=None, hf_model_type=None, dataset_cls=None,
        data_config=DictConfigWrap(config.data), tools=ToolListWrap([]))
    client, request, wait = loop.service
    assert type(loop) is cls and request == REQUEST and wait == 30.0
    assert client.redis_url == "redis://127.0.0.1:1/0"
    print("verl: a fresh process resolves", cls)
    """
)

SKYRL = textwrap.dedent(
    """
    import collections.abc, torch
    from trainer_stub.adapters.samples import samples_of_row
    from trainer_stub.adapters import skyrl_generator as adapter

    gen = adapter.skyrl_generator(FakeClient([]), REQUEST)  # imports skyrl (see its docstring)
    from skyrl.train.generators.base import (
        BatchMetadata, GeneratorInput, GeneratorInterface, GeneratorOutput, TrajectoryID)
    from skyrl.train.utils.trainer_utils import validate_generator_output
    from importlib.metadata import version
    assert version("skyrl") == "0.3.0", version("skyrl")

    def conforms(value, hint):
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is typing.Any:
            return True
        if origin is typing.Union:
            return any(conforms(value, a) for a in args)
        if hint is type(None):
            return value is None
        if origin in (list, collections.abc.Sequence):
            return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
        if origin is dict:
            return isinstance(value, dict) and all(
                conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
        if hint is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if hint is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, hint)

    out_hints = typing.get_type_hints(GeneratorOutput)
    in_hints = typing.get_type_hints(GeneratorInput)
    assert GeneratorOutput.__required_keys__ == set(out_hints), "GeneratorOutput is not total"

    ids = [TrajectoryID("a", 0), TrajectoryID("a", 1), TrajectoryID("a", 2), TrajectoryID("b", 0)]
    batch = {
        "prompts": [[{"role": "user", "content": "x"}]] * 4,
        "env_classes": ["rollout"] * 4,
        "env_extras": [{"task_id": t.instance_id} for t in ids],
        "sampling_params": None,
        "trajectory_ids": ids,
        "batch_metadata": BatchMetadata(global_step=1, training_phase="train"),
    }
    assert set(batch) == set(in_hints) and all(conforms(batch[k], h) for k, h in in_hints.items())
    rows = [row("a", 0, reward=1.0), row("a", 1, status="failed"), row("a", 2, reward=0.0),
            row("b", 0, tokens=STEPWISE, reward=1.0)]
    assert issubclass(type(gen), GeneratorInterface) and not inspect.isabstract(type(gen))
    base = inspect.signature(GeneratorInterface.generate)
    ours = inspect.signature(type(gen).generate)
    assert list(base.parameters) == list(ours.parameters), (base, ours)
    for step_wise in (False, True):
        gen = adapter.skyrl_generator(FakeClient(rows), REQUEST, step_wise=step_wise)
        out = asyncio.run(gen.generate(batch))
        assert set(out) == set(out_hints), set(out) ^ set(out_hints)
        wrong = [k for k, h in out_hints.items() if not conforms(out[k], h)]
        assert not wrong, {k: out[k] for k in wrong}
        validate_generator_output(len(batch["prompts"]), out, step_wise=step_wise)
        assert len(out["response_ids"]) == (5 if step_wise else 4)
    print("skyrl: GeneratorOutput keys", sorted(out_hints))
    """
)


# One step of each adapter against the real service: a private Redis and real workers (the
# local backend's sandboxes), the tiny engine serving the policy (trainer_stub.engine), the
# learning benchmark's tasks. verl's loops (one per sample, built by hydra as its worker builds
# them) and SkyRL's generator each get their samples back with the engine's own token ids.
LIVE = textwrap.dedent(
    """
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import agent_loop as real
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap
    from benchmarks.bench_learning import drift, learning_request
    from rollout_worker.cli.stack import LocalStack
    from trainer_stub import engine
    from trainer_stub.adapters import skyrl_generator as sky, verl_loop
    from trainer_stub.adapters.samples import samples_of_row
    from trainer_stub.client import RolloutClient

    class Recording(RolloutClient):
        batches = []
        def submit(self, **fields):
            submission = super().submit(**fields)
            self.batches.append(submission.batch_id)
            return submission

    def samples_of(client, batch_id):
        # (each episode's last turn, what verl's loop and SkyRL's generator hand back; every
        # turn, for the drift check against the engine's own ledger)
        episodes = [samples_of_row(r) for _, rows in client.sampled_groups(batch_id, 60)
                    for r in rows]
        turns = [s for episode in episodes for s in episode if s.usable]
        return [e[-1] for e in episodes if e[-1].usable], turns

    with LocalStack(collectors=1) as stack:
        stack.wait_ready()
        server = engine.EngineServer(engine.build_model(seed=0)).start()
        client = Recording(stack.redis_url)
        try:
            request = learning_request(server.url, 1)
            tasks = [str(t["id"]) for t in request["tasks"]]
            asks = [t for t in tasks for _ in range(2)]

            verl_loop.register_agent_loop("rollout_live", client, request, timeout=300)
            config = OmegaConf.create(
                {"actor_rollout_ref": {"rollout": {}}, "data": {"apply_chat_template_kwargs": {}}})
            def loop():
                return hydra.utils.instantiate(
                    config=real._agent_loop_registry["rollout_live"],
                    trainer_config=DictConfigWrap(config=config), server_manager=None,
                    tokenizer=engine.build_tokenizer(), processor=None, hf_model_type=None,
                    dataset_cls=None, data_config=DictConfigWrap(config.data),
                    tools=real.ToolListWrap([]))
            async def verl_step():
                return await asyncio.gather(*(
                    loop().run({"temperature": 1.0}, extra_info={"task_id": t}, index=i)
                    for i, t in enumerate(asks)))
            outs = asyncio.run(verl_step())
            assert len(client.batches) == 1, client.batches  # the loops' asks: one batch
            found, turns = samples_of(client, client.batches[0])
            assert all(isinstance(o, AgentLoopOutput) for o in outs)
            got = sorted(o.response_ids for o in outs)
            assert got == sorted(s.response_ids for s in found), (got, found)
            checked, mismatched = drift(turns, server.ledger())
            assert checked >= len(asks) and mismatched == 0, (checked, mismatched)
            print(f"verl live: {len(outs)} loops, 1 batch, {checked} turns, 0 drift")

            generator = sky.skyrl_generator(client, request)  # imports skyrl (its docstring)
            from skyrl.train.generators.base import BatchMetadata, TrajectoryID
            from skyrl.train.utils.trainer_utils import validate_generator_output
            ids = [TrajectoryID(t, k) for t in tasks for k in range(2)]  # GRPO's repetitions
            batch = {
                "prompts": [[{"role": "user", "content": "x"}]] * len(ids),
                "env_classes": ["rollout"] * len(ids),
                "env_extras": [{"task_id": i.instance_id} for i in ids],
                "sampling_params": None,
                "trajectory_ids": ids,
                "batch_metadata": BatchMetadata(global_step=1, training_phase="train"),
            }
            out = asyncio.run(generator.generate(batch))
            validate_generator_output(len(ids), out)
            found, turns = samples_of(client, client.batches[-1])
            assert sorted(out["response_ids"]) == sorted(s.response_ids for s in found)
            checked, mismatched = drift(turns, server.ledger())
            assert checked >= len(asks) and mismatched == 0, (checked, mismatched)
            print(f"skyrl live: {len(out['response_ids'])} samples, {checked} turns, 0 drift")
        finally:
            client.close()
            server.close()
    """
)


def libs() -> Path:
    where = Path(os.environ.get("ROLLOUT_TRAINER_LIBS") or ROOT / ".cache" / "trainer-libs")
    return where if where.is_absolute() else ROOT / where


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    """hack/trainer-libs.sh (instant when its folders have their pins); a failure fails."""
    subprocess.run([str(ROOT / "hack" / "trainer-libs.sh")], check=True, timeout=600)


def run(code: str, *folders: str) -> str:
    path = os.pathsep.join([*(str(libs() / f) for f in folders), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", COMMON + code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    return done.stdout


def test_verl_takes_the_adapters_output_and_loop():
    assert "run -> 1.0" in run(VERL, "verl")


def test_verl_workers_find_the_loop_by_its_path():
    assert "fresh process resolves" in run(VERL_WORKER, "verl")


def test_skyrl_takes_the_adapters_output_and_generator():
    # ray (for SkyRL's validate_generator_output) comes from the verl folder.
    assert "GeneratorOutput keys" in run(SKYRL, "skyrl", "verl")


@pytest.mark.redis
@pytest.mark.workers
@pytest.mark.slow
def test_verl_loops_and_the_skyrl_generator_take_a_step_through_the_real_service():
    out = run(LIVE, "skyrl", "verl")
    assert "verl live" in out and "skyrl live" in out, out
