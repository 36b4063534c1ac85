"""`trainer-stub`: play the trainer. Runs several sampling rounds at once and prints each report."""

from __future__ import annotations

import sys

import click
import orjson
from rich.console import Console

from rollout_wire.errors import InvalidSpec, RolloutError
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
@click.option("--count", type=int, default=10, show_default=True, help="Episodes per round.")
@click.option("--parallelism", type=int, default=None, help="[default: count]")
@click.option("--backend", default="local", show_default=True)
@click.option("--timeout", type=float, default=600, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON lines.")
def main(
    redis_url: str,
    rounds: int,
    count: int,
    parallelism: int | None,
    backend: str,
    timeout: float,
    as_json: bool,
) -> None:
    """Submit ROUNDS batches concurrently, follow them live, print every report."""
    if rounds < 1:
        raise click.UsageError("--rounds must be at least 1")
    client = RolloutClient(redis_url)
    try:
        submissions = [
            client.submit(
                count=count, parallelism=parallelism, backend=backend, labels={"round": str(n)}
            )
            for n in range(rounds)
        ]
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
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


if __name__ == "__main__":
    main()
