"""`trainer-stub`: play the trainer. Runs several sampling rounds at once and prints each report."""

from __future__ import annotations

import sys
from typing import Any

import click
import orjson
from rich.console import Console
from rich.table import Table

from rollout_wire.errors import InvalidSpec, RolloutError
from rollout_wire.states import EpisodeStatus
from rollout_wire.tasksets import parse_sampling, rollout_fields
from trainer_stub import options
from trainer_stub.client import RolloutClient
from trainer_stub.display import follow, print_errors, summary_table

console = Console()
err = Console(stderr=True, soft_wrap=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--redis-url",
    envvar="ROLLOUT_REDIS_URL",
    default="redis://127.0.0.1:6379/0",
    show_default=True,
    help="[env ROLLOUT_REDIS_URL]",
)
@click.option(
    "--rounds",
    type=int,
    default=3,
    show_default=True,
    help="Sampling rounds submitted at the same time.",
)
@options.count("Episodes per round.")
@options.parallelism("[default: count]")
@options.backend()
@click.option("--timeout", type=float, default=600, show_default=True)
@options.as_json("Print the reports as JSON lines.")
@options.tasks("Real rollouts: the task set; rounds then run one after the other, like training.")
@options.only_tasks("Only this task of --tasks.")
@options.samples("Samples per task.", default=4)
@options.policy_url()
@options.model()
@options.sampling("Sampling parameter.")
@options.infra_retries(
    "Retries of an episode failed for infrastructure reasons (fresh sandbox each)."
)
def main(
    redis_url: str,
    rounds: int,
    count: int,
    parallelism: int | None,
    backend: str,
    timeout: float,
    as_json: bool,
    task_set: str | None,
    only_tasks: tuple[str, ...],
    samples: int,
    policy_url: str | None,
    model: str | None,
    sampling: tuple[str, ...],
    infra_retries: int | None,
) -> None:
    """Submit ROUNDS batches concurrently, follow them live, print every report.

    With --tasks and --policy-url: the shape of a training loop instead. Each round submits
    every task x --samples, streams the trajectories as episodes finish, and prints each task's
    group rewards (mean, std, pass@k) before the next round (where a trainer would update the
    policy)."""
    if rounds < 1:
        raise click.UsageError("--rounds must be at least 1")
    if task_set is not None:
        training_loop(
            redis_url,
            rounds,
            task_set,
            only_tasks,
            samples,
            policy_url,
            model,
            sampling,
            parallelism,
            backend,
            timeout,
            as_json,
            infra_retries,
        )
        return
    client = _client(redis_url)
    try:
        submissions = [
            client.submit(
                count=count, parallelism=parallelism, backend=backend, labels={"round": str(n)}
            )
            for n in range(rounds)
        ]
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    except RolloutError as exc:  # Redis unreachable for the client's outage limit
        raise click.ClickException(str(exc)) from exc
    try:
        reports = follow(client, submissions, err, timeout)
    except RolloutError as exc:
        raise click.ClickException(str(exc)) from exc
    ordered = [reports[s.batch_id] for s in submissions]
    if as_json:
        for report in ordered:
            sys.stdout.write(
                orjson.dumps({k: v for k, v in report.items() if k != "pods"}).decode() + "\n"
            )
    else:
        console.print(summary_table(ordered, submissions))
        for report in ordered:
            print_errors(err, report)
    client.close()
    sys.exit(0 if all(r.get("ok") for r in ordered) else 1)


def training_loop(
    redis_url: str,
    rounds: int,
    task_set: str,
    only_tasks: tuple[str, ...],
    samples: int,
    policy_url: str | None,
    model: str | None,
    sampling: tuple[str, ...],
    parallelism: int | None,
    backend: str,
    timeout: float,
    as_json: bool,
    infra_retries: int | None = None,
) -> None:
    client = _client(redis_url)
    try:
        fields = rollout_fields(
            tasks=task_set,
            only=only_tasks,
            samples=samples,
            policy_url=policy_url,
            model=model,
            sampling=parse_sampling(sampling),
            infra_retries=infra_retries,
        )
        prepared = [
            client.prepare(
                fields
                | {"parallelism": parallelism, "backend": backend, "labels": {"round": str(n)}}
            )
            for n in range(rounds)
        ]
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    all_ok = True
    for n, spec in enumerate(prepared):
        try:
            submission = client.send(spec)
        except RolloutError as exc:
            raise click.ClickException(str(exc)) from exc
        err.print(f"round {n}: batch {spec.batch_id}, {spec.count} episodes", highlight=False)
        try:
            for row, trajectory in client.trajectories(spec.batch_id, timeout):
                steps = len(trajectory["steps"]) if trajectory else 0
                what = (
                    f"reward {row['reward']:g}"
                    if row["status"] == EpisodeStatus.OK
                    else f"{row['status']} ({row.get('failure_kind')}: {row.get('failure_cause')})"
                )
                err.print(
                    f"  episode {row['index']:>3} {row.get('task_id')} #{row.get('sample')}: "
                    f"{steps} steps, {what}",
                    highlight=False,
                )
            report = submission.wait(30)
        except RolloutError as exc:
            raise click.ClickException(str(exc)) from exc
        all_ok = all_ok and bool(report.get("ok"))
        if as_json:
            sys.stdout.write(
                orjson.dumps({"round": n, "groups": report.get("groups", [])}).decode() + "\n"
            )
            continue
        console.print(group_table(n, report))
    client.close()
    sys.exit(0 if all_ok else 1)


def _client(redis_url: str) -> RolloutClient:
    """The client; every Redis call it makes waits out an outage for up to
    ROLLOUT_REDIS_OUTAGE_SECONDS, then says so in one line (never a traceback)."""
    try:
        return RolloutClient(redis_url)
    except RolloutError as exc:  # a bad ROLLOUT_REDIS_OUTAGE_SECONDS
        raise click.UsageError(str(exc)) from exc


def group_table(round_no: int, report: dict[str, Any]) -> Table:
    batch = report.get("batch_id")
    table = Table(title=f"round {round_no}: group rewards (group id = {batch}:<task>)")
    for column in ("task", "rewards", "mean", "std", "pass@1", "pass@k", "failed"):
        table.add_column(column)
    for group in report.get("groups", []):
        passes = group["pass_at_k"]
        top = max(passes, key=int) if passes else None

        def num(value: Any) -> str:
            return "-" if value is None else f"{value:.3f}"

        table.add_row(
            group["task_id"],
            " ".join(f"{r:g}" for r in group["rewards"]),
            num(group["mean"]),
            num(group["std"]),
            num(passes.get("1")),
            f"{num(passes[top])} (k={top})" if top else "-",
            ", ".join(f"#{f['sample']} {f['failure_kind']}" for f in group["failed"]) or "",
        )
    return table


if __name__ == "__main__":
    main()
