"""`trainer-stub`: play the trainer. Runs several sampling rounds at once and prints each report."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import orjson
from rich.console import Console
from rich.table import Table

from rollout_wire import constants as k
from rollout_wire.errors import InvalidSpec, RolloutError
from rollout_wire.states import EpisodeStatus
from rollout_wire.tasksets import parse_sampling, rollout_fields
from trainer_stub import options
from trainer_stub.client import RolloutClient
from trainer_stub.display import (
    GROUP_COLUMNS,
    follow,
    group_cells,
    group_table,
    print_errors,
    summary_table,
)

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
@options.groups_wanted()
@options.group_filter()
@click.option(
    "--continuous",
    is_flag=True,
    help="With --tasks: continuous sampling instead of rounds: --groups-in-flight groups kept "
    "running, each complete group printed as it comes, until ROUNDS x tasks groups were given.",
)
@click.option(
    "--groups-in-flight",
    type=int,
    default=None,
    help="With --continuous: groups kept running. [default: the number of tasks]",
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
    groups_wanted: int | None,
    group_filter: str | None,
    continuous: bool,
    groups_in_flight: int | None,
) -> None:
    """Submit ROUNDS batches concurrently, follow them live, print every report.

    With --tasks and --policy-url: the shape of a training loop instead. Each round submits
    every task x --samples, streams the trajectories as episodes finish, and prints each task's
    group rewards (mean, std, pass@k) before the next round (where a trainer would update the
    policy). With --continuous: groups as they complete, never a round waiting for its slowest
    episode."""
    if rounds < 1:
        raise click.UsageError("--rounds must be at least 1")
    if continuous:
        if task_set is None:
            raise click.UsageError("--continuous needs --tasks")
        fields = _rollout_fields(
            task_set, only_tasks, samples, policy_url, model, sampling, infra_retries
        )
        continuous_sampling(
            redis_url,
            fields,
            rounds * len(fields["tasks"]),
            groups_in_flight or len(fields["tasks"]),
            group_filter or "any",
            {"parallelism": parallelism, "backend": backend},
            timeout,
            as_json,
        )
        return
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
            groups_wanted,
            group_filter,
        )
        return
    demo_rounds(redis_url, rounds, count, parallelism, backend, timeout, as_json)


def demo_rounds(
    redis_url: str,
    rounds: int,
    count: int,
    parallelism: int | None,
    backend: str,
    timeout: float,
    as_json: bool,
) -> None:
    """Without --tasks: ROUNDS batches of the guide's demo task submitted at once, followed
    live, their reports printed; exit status 1 unless every one is ok."""
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
    groups_wanted: int | None = None,
    group_filter: str | None = None,
) -> None:
    client = _client(redis_url)
    try:
        fields = _rollout_fields(
            task_set, only_tasks, samples, policy_url, model, sampling, infra_retries
        )
        if groups_wanted is not None:
            fields["groups_wanted"] = groups_wanted
        if group_filter is not None:
            fields["group_filter"] = group_filter
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
            groups_done = 0
            for _, entry in client.entries([spec.batch_id], timeout):
                if entry.type == k.ENTRY_EPISODE and entry.row is not None:
                    row = entry.row
                    trajectory = client.trajectory(spec.batch_id, int(row["index"]))
                    steps = len(trajectory["steps"]) if trajectory else 0
                    what = (
                        f"reward {row['reward']:g}"
                        if row["status"] == EpisodeStatus.OK
                        else f"{row['status']} ({row.get('failure_kind')}: "
                        f"{row.get('failure_cause')})"
                    )
                    err.print(
                        f"  episode {row['index']:>3} {row.get('task_id')} "
                        f"#{row.get('sample')}: {steps} steps, {what}",
                        highlight=False,
                    )
                elif entry.type == k.ENTRY_GROUP and entry.group is not None:
                    groups_done += 1
                    err.print(
                        f"  group {groups_done}/{len(spec.tasks)} done: "
                        + _group_line(entry.group),
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
        console.print(group_table(report, f"round {n}: groups of batch {spec.batch_id}"))
    client.close()
    sys.exit(0 if all_ok else 1)


def continuous_sampling(
    redis_url: str,
    fields: dict[str, Any],
    total: int,
    in_flight: int,
    group_filter: str,
    request: dict[str, Any],
    timeout: float,
    as_json: bool,
) -> None:
    """`client.sample`: print each group as it completes; then groups per second."""
    client = _client(redis_url)
    tasks, samples = fields.pop("tasks"), fields.pop("samples_per_task", 4)
    started, given = time.monotonic(), []
    try:
        groups = client.sample(
            tasks,
            samples,
            groups_in_flight=in_flight,
            total_groups=total,
            group_filter=group_filter,
            timeout=timeout,
            **fields,
            **request,
        )
        for group in groups:
            given.append(group)
            if as_json:
                sys.stdout.write(orjson.dumps(group).decode() + "\n")
            else:
                err.print(f"group {len(given)}/{total}: " + _group_line(group), highlight=False)
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    except (RolloutError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    took = time.monotonic() - started
    if not as_json:
        table = Table(
            title=f"continuous sampling: {len(given)} groups in {took:.1f}s "
            f"({len(given) / took:.2f} groups/s, {in_flight} in flight)"
        )
        for column in GROUP_COLUMNS:
            table.add_column(column, no_wrap=column != "rewards")
        for group in given:
            table.add_row(*group_cells(group))
        console.print(table)
    client.close()
    sys.exit(0 if len(given) == total else 1)


def _group_line(group: dict[str, Any]) -> str:
    mean = group.get("mean")
    rewards = " ".join(f"{r:g}" for r in group.get("rewards", []))
    shown = "-" if mean is None else f"{mean:.3f}"
    return (
        f"{group.get('task_id')} [{rewards}] mean {shown} pass@1 "
        f"{(group.get('pass_at_k') or {}).get('1', '-')} {group.get('status')}"
        + (" (counted)" if group.get("counted") else "")
    )


def _rollout_fields(
    task_set: str,
    only_tasks: tuple[str, ...],
    samples: int,
    policy_url: str | None,
    model: str | None,
    sampling: tuple[str, ...],
    infra_retries: int | None,
) -> dict[str, Any]:
    try:
        return rollout_fields(
            tasks=task_set,
            only=only_tasks,
            samples=samples,
            policy_url=policy_url,
            model=model,
            sampling=parse_sampling(sampling),
            infra_retries=infra_retries,
        )
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc


def _client(redis_url: str) -> RolloutClient:
    """The client; every Redis call it makes waits out an outage for up to
    ROLLOUT_REDIS_OUTAGE_SECONDS, then says so in one line (never a traceback)."""
    try:
        return RolloutClient(redis_url)
    except RolloutError as exc:  # a bad ROLLOUT_REDIS_OUTAGE_SECONDS
        raise click.UsageError(str(exc)) from exc


if __name__ == "__main__":
    main()
