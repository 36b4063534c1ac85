"""The batch options `trainer-stub` and `rollout run` share, defined once (click decorators).

Each names its flag, parameter, type and metavar here, so both commands parse a request the same
way; where the two commands say it differently (one batch or one round each), the help text (or
the default) is an argument. Imports click only: `rollout_worker.cli.run` imports this module,
never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[F], F]


def count(help: str) -> Decorator:
    return click.option("--count", type=int, default=10, show_default=True, help=help)


def parallelism(help: str) -> Decorator:
    return click.option("--parallelism", type=int, default=None, help=help)


def backend(choices: Sequence[str] | None = None) -> Decorator:
    """--backend, checked against `choices` when they are given (else by the request's parse)."""
    return click.option(
        "--backend",
        type=click.Choice(choices) if choices is not None else None,
        default="local",
        show_default=True,
    )


def as_json(help: str) -> Decorator:
    return click.option("--json", "as_json", is_flag=True, help=help)


def tasks(help: str) -> Decorator:
    return click.option("--tasks", "task_set", default=None, metavar="FILE|bundled", help=help)


def only_tasks(help: str) -> Decorator:
    return click.option("--task", "only_tasks", multiple=True, help=help)


def samples(help: str, default: int | None = None) -> Decorator:
    shown = True if default is not None else None
    return click.option("--samples", type=int, default=default, show_default=shown, help=help)


def policy_url() -> Decorator:
    return click.option(
        "--policy-url", default=None, help="The policy's chat completions server root."
    )


def model() -> Decorator:
    return click.option("--model", default=None, help="Model name sent to the policy.")


def sampling(help: str) -> Decorator:
    return click.option("--sampling", multiple=True, metavar="KEY=VALUE", help=help)


def infra_retries(help: str) -> Decorator:
    return click.option("--infra-retries", type=int, default=None, help=help)


def groups_wanted() -> Decorator:
    return click.option(
        "--groups-wanted",
        type=int,
        default=None,
        help="Quota: the batch is over once this many groups passing --group-filter are "
        "complete; the rest is aborted (README: Groups as they finish).",
    )


def group_filter() -> Decorator:
    return click.option(
        "--group-filter",
        type=click.Choice(["any", "varied"]),
        default=None,
        help="Which complete groups count: any, or varied (two distinct rewards at least). "
        "[default: any]",
    )
