"""Where a batch's sandboxes run on Kubernetes (image, RuntimeClass, pull policy, node selector,
tolerations, what a lack of room does), as the options of every command that submits batches:
`rollout run` and `rollout tasks check`. The command gets them as one `placement` dict of the
batch fields they set."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from rollout_wire.request import DEFAULT_IMAGE, DEFAULT_RUNTIME, ISOLATIONS

NAMES = (
    "isolation",
    "image",
    "runtime",
    "image_pull_policy",
    "node_selector",
    "toleration",
    "capacity_check",
)


def options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The placement options, handed to `command` as `placement` (batch fields)."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in NAMES}
        return command(**kwargs, placement=fields(**given))

    decorators = [
        click.option(
            "--isolation",
            type=click.Choice(ISOLATIONS),
            default="pod",
            show_default=True,
            help="kubernetes: a Pod per episode (pod), or bubblewrap sandboxes in the "
            "sandbox-host Pods (host).",
        ),
        click.option(
            "--image",
            default=DEFAULT_IMAGE,
            show_default=True,
            help="Sandbox image (kubernetes backend).",
        ),
        click.option(
            "--runtime",
            default=DEFAULT_RUNTIME,
            show_default=True,
            help="RuntimeClass (kubernetes backend).",
        ),
        click.option(
            "--image-pull-policy",
            type=click.Choice(["IfNotPresent", "Never", "Always"]),
            default="IfNotPresent",
            show_default=True,
        ),
        click.option(
            "--node-selector",
            multiple=True,
            metavar="KEY=VALUE",
            help="Node label the sandboxes require (kubernetes; repeatable).",
        ),
        click.option(
            "--toleration",
            multiple=True,
            metavar="KEY[=VALUE]:EFFECT",
            help="Taint the sandboxes tolerate (kubernetes; repeatable).",
        ),
        click.option(
            "--capacity-check",
            type=click.Choice(["error", "warn", "off"]),
            default="error",
            show_default=True,
            help="What to do when the cluster lacks room (kubernetes).",
        ),
    ]
    for decorate in reversed(decorators):
        wrapper = decorate(wrapper)
    return wrapper


def fields(
    *,
    isolation: str,
    image: str,
    runtime: str,
    image_pull_policy: str,
    node_selector: tuple[str, ...],
    toleration: tuple[str, ...],
    capacity_check: str,
) -> dict[str, Any]:
    return {
        "isolation": isolation,
        "image": image,
        "runtime": runtime,
        "image_pull_policy": image_pull_policy,
        "node_selector": dict(_pair(item, "--node-selector") for item in node_selector),
        "tolerations": [_toleration(item) for item in toleration],
        "capacity_check": capacity_check,
    }


def _pair(text: str, option: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.UsageError(f"{option} {text!r} must look like KEY=VALUE")
    return key, value


def _toleration(text: str) -> dict[str, str]:
    """'key=value:NoSchedule' -> Equal, 'key:NoSchedule' -> Exists."""
    target, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or not target:
        raise click.UsageError(
            f"--toleration {text!r} must look like KEY[=VALUE]:EFFECT with "
            "EFFECT NoSchedule, PreferNoSchedule or NoExecute"
        )
    key, eq, value = target.partition("=")
    if eq:
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}
