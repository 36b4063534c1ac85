"""A real model learns through the service (not a test): TRL's GRPO trainer on the CPU with
the `rollout_func` adapter, a tiny causal LM (trainer_stub/engine.py, built at random in the
process) served to the sandboxes, the learning task set graded by its sandboxed tests.

Each step submits the tasks x samples to real workers (a private Redis and Celery workers, the
local backend's bubblewrap sandboxes); each episode's agent (rollout_worker/data/agents/
answer_file_agent.py, two turns) asks the engine through the recording proxy and writes the
last answer where the hidden tests read it; the groups come back with their token views; the
trainer updates the weights the engine serves (the same model object, in this process) and
publishes the new version to the engine and the service (the staleness bound then applies).

Printed: the reward curve (mean reward per step), the drift count (turns whose recorded ids
differ from what the engine was shown and sampled, checked against the engine's own ledger),
seconds per step and the share spent sampling (sandboxes and the agent), grading (the tests,
from the episodes' own phases) and in the optimizer, and the load average. `--plot` draws
the curve.

    python -m benchmarks.bench_learning [--steps 36] [--samples 8] [--runs 3] [--plot FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.stack import LocalStack
from trainer_stub.adapters.samples import TrainingSample, samples_of_row
from trainer_stub.adapters.trl_rollout import TRLRollouts, publish_versions, rollout_reward
from trainer_stub.client import RolloutClient

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "learn"
AGENT = ROOT / "rollout_worker" / "data" / "agents" / "answer_file_agent.py"


def learning_request(url: str, samples: int) -> dict[str, Any]:
    return {
        "tasks": load_task_set(str(TASKS)),
        "samples_per_task": samples,
        "parallelism": 8,
        "agent": {
            "command": ["python", "-c", AGENT.read_text()],
            "env": {"AGENT_MAX_TOKENS": "8", "AGENT_TURNS": "2"},
        },
        "policy": {
            "url": url,
            "sampling": {"temperature": 1.0},
            "request_timeout_seconds": 30,
            "max_policy_lag": 1,
        },
    }


def drift(
    samples: list[TrainingSample], ledger: dict[str, list[dict[str, Any]]]
) -> tuple[int, int]:
    """(turns checked, turns whose recorded ids differ from the engine's): each episode's
    turns, rebuilt from its token view, against what the engine logged for that episode."""
    checked = mismatched = 0
    for sample in samples:
        answered = ledger.get(sample.episode_id, [])
        if sample.turn is not None:  # a stepwise episode's turn
            turns = [(sample.prompt_ids, sample.response_ids)]
            answered = answered[sample.turn - 1 : sample.turn]
        else:
            whole = sample.prompt_ids + sample.response_ids
            turns = []
            bounds = _model_spans(sample.response_mask)
            for start, end in bounds:
                at = len(sample.prompt_ids) + start
                turns.append((whole[:at], whole[at : len(sample.prompt_ids) + end]))
        for number, (prompt, completion) in enumerate(turns):
            checked += 1
            engine = answered[number] if number < len(answered) else None
            if engine is None or (engine["prompt_ids"], engine["completion_ids"]) != (
                prompt,
                completion,
            ):
                mismatched += 1
    return checked, mismatched


def _model_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for position, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = position
        elif not bit and start is not None:
            spans.append((start, position))
            start = None
    return spans


def grading_fraction(rows: list[dict[str, Any]]) -> float:
    """The tests' share of the episodes' summed wall (cost.wall phases)."""
    phases = [(row.get("cost") or {}).get("wall") or {} for row in rows]
    total = sum(v for wall in phases for v in wall.values() if isinstance(v, (int, float)))
    tests = sum(wall.get("tests") or 0 for wall in phases)
    return tests / total if total else 0.0


def one_run(steps: int, samples: int, seed: int, lr: float) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trainer_stub import engine

    with LocalStack(collectors=1) as stack:
        stack.wait_ready()
        model = engine.build_model(seed=seed)
        server = engine.EngineServer(model).start()
        client = RolloutClient(stack.redis_url)
        try:
            rollouts = TRLRollouts(client, learning_request(server.url, samples))
            tasks = len(rollouts.tasks)
            config = GRPOConfig(
                output_dir=tempfile.mkdtemp(prefix="bench-learning-"),
                per_device_train_batch_size=tasks * samples,
                num_generations=samples,
                max_steps=steps,
                learning_rate=lr,
                lr_scheduler_type="constant",
                # Each step samples every task (a shuffled order can give one task twice).
                shuffle_dataset=False,
                beta=0.0,
                logging_steps=1,
                report_to=[],
                save_strategy="no",
                use_cpu=True,
                seed=seed,
                max_completion_length=64,
            )
            trainer = GRPOTrainer(
                model=model,
                processing_class=engine.build_tokenizer(),
                reward_funcs=[rollout_reward],
                args=config,
                train_dataset=Dataset.from_list(rollouts.dataset(repeats=steps * samples)),
                rollout_func=rollouts,
                callbacks=[publish_versions(client, on_version=server.set_version)],
            )
            started = time.monotonic()
            trainer.train()
            wall = time.monotonic() - started
            ledger = server.ledger()
            published = client.policy_version()
            checked = mismatched = 0
            grading = 0.0
            for batch in rollouts.batches:
                rows = [
                    row for _, group in client.sampled_groups(batch.batch_id, 60) for row in group
                ]
                found = [s for row in rows for s in samples_of_row(row) if s.usable]
                c, m = drift(found, ledger)
                checked, mismatched = checked + c, mismatched + m
                grading += batch.seconds * grading_fraction(rows)
        finally:
            client.close()
            server.close()
    curve = [
        statistics.fmean([r for r in b.rewards if r is not None] or [0.0]) for b in rollouts.batches
    ]
    sampling = sum(b.seconds for b in rollouts.batches)
    return {
        "curve": [round(x, 3) for x in curve],
        "first3": round(statistics.fmean(curve[:3]), 3),
        "last3": round(statistics.fmean(curve[-3:]), 3),
        "wall_seconds": round(wall, 1),
        "seconds_per_step": round(wall / max(1, len(curve)), 2),
        # Sampling (a batch's wall) split by its episodes' own phases: the tests' part of
        # their summed wall is the grading share; the rest, sandbox start and the agent.
        "sampling_share": round((sampling - grading) / wall, 3),
        "grading_share": round(grading / wall, 3),
        "optimizer_share": round(1 - sampling / wall, 3),
        "turns_checked": checked,
        "drift_mismatches": mismatched,
        "published_version": published,
        "engine_version": server.version,
        "statuses": sorted({s for b in rollouts.batches for s in b.statuses}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = []
    for run in range(args.runs):
        result = one_run(args.steps, args.samples, seed=run, lr=args.lr)
        print(f"run {run}: {result}", flush=True)
        results.append(result)
    gains = [r["last3"] - r["first3"] for r in results]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in results)

    turns = sum(r["turns_checked"] for r in results)
    print(
        f"median over {len(results)} runs: reward gain (last 3 - first 3 steps) "
        f"{statistics.median(gains):.3f}, wall {median('wall_seconds')} s, s/step "
        f"{median('seconds_per_step')}, shares: sampling {median('sampling_share')} grading "
        f"{median('grading_share')} optimizer {median('optimizer_share')}, drift "
        f"{sum(r['drift_mismatches'] for r in results)} of {turns} turns"
    )
    print(f"load average after: {os.getloadavg()}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6, 3.5))
        for run, result in enumerate(results):
            axes.plot(range(1, len(result["curve"]) + 1), result["curve"], label=f"run {run}")
        axes.set_xlabel("GRPO step")
        axes.set_ylabel("mean reward (sandboxed tests)")
        axes.set_ylim(0, 1)
        axes.set_title("A tiny model learning through the rollout service (CPU)")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
