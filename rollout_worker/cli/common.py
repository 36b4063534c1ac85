"""What the `rollout` commands share: their consoles, the --redis-url option, settings from the
environment, and how long a command waits for a run to be deleted.

Imported by `rollout worker` too (through `main.py`): rich loads only when a console is first
used, never at import.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import click

from rollout_wire.errors import RolloutError, TaskWarning
from rollout_worker.settings import Settings

if TYPE_CHECKING:
    from rich.console import Console

# How long a command waits for a run to be deleted: `rollout cleanup` for the run it deletes,
# `rollout run --all-in-one` for its run after the report (before it stops its private stack).
CLEANUP_WAIT_SECONDS = 120.0


@functools.cache
def console(stderr: bool) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=stderr)


def out(*args: Any, **kwargs: Any) -> None:
    console(False).print(*args, **kwargs)


def err(*args: Any, **kwargs: Any) -> None:
    console(True).print(*args, **kwargs)


redis_option = click.option(
    "--redis-url",
    envvar="ROLLOUT_REDIS_URL",
    default=None,
    help="Redis URL (broker, results, reports). [env ROLLOUT_REDIS_URL]",
)


def load_settings(redis_url: str | None) -> Settings:
    """Settings from the environment, with --redis-url over ROLLOUT_REDIS_URL when given; a bad
    variable is a usage error."""
    try:
        settings = Settings.from_env()
    except RolloutError as exc:
        raise click.UsageError(str(exc)) from exc
    return settings.with_redis(redis_url) if redis_url else settings


def print_task_warnings(messages: Iterable[str]) -> None:
    """What a task set lets through without honouring it, on stderr before anything runs."""
    for message in messages:
        err(f"warning: {message}", markup=False, highlight=False)


@contextlib.contextmanager
def task_warnings_printed() -> Iterator[None]:
    """Loads tasks within: each TaskWarning they raise is printed once as `warning: ...`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TaskWarning)
        yield
    for warning in caught:
        if issubclass(warning.category, TaskWarning):
            print_task_warnings([str(warning.message)])
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )


allow_unknown_keys_option = click.option(
    "--allow-unknown-keys",
    is_flag=True,
    help="A Harbor task.toml key this project does not know is a warning (listed before the "
    "run) instead of a refusal.",
)
