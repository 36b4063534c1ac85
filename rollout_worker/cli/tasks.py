"""`rollout tasks`: look at a task set, and build the images of Harbor tasks.

`show REF` prints what a batch would carry (REF: a Harbor folder, a JSON task set or "bundled").
`build DIR` runs `docker build` for every Harbor task with an environment/Dockerfile, under the
name the mapping gave it (`rollout_wire.harbor.local_image_name`), then optionally puts the
image where a backend finds it: the local cluster's real node (`--node-import`), a registry
(`--push`), or an extracted root filesystem for the local backend (`--rootfs`).
`check DIR` builds the same way, then runs every task's oracle (and with --nop an agent that
does nothing) and judges the rows (the verdict: `rollout_worker.cli.check`).

The commands are built by pure functions (`image_commands`, `base_images`: argv lists, tested
without Docker) and run by `image_build`; the click commands here only wire them up.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from rollout_wire.errors import InvalidSpec
from rollout_worker.cli import placement
from rollout_worker.cli.common import (
    allow_unknown_keys_option,
    load_settings,
    print_task_warnings,
    redis_option,
    task_warnings_printed,
)
from rollout_worker.cli.image_build import build_images, preflight
from rollout_worker.cli.image_commands import check_registry, containerd_socket, plan


def _problems_exit(problems: Sequence[str]) -> NoReturn:
    for line in problems:
        click.echo(f"error: {line}", err=True)
    sys.exit(1)


@click.group()
def tasks() -> None:
    """Show a task set; build the images of Harbor tasks; check every task's oracle."""


def summary_rows(task_list: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per task: id, statement's first line, image or files, tests, solution, limit."""
    from rollout_wire.request import DEFAULT_TASK_TIME_LIMIT_SECONDS
    from rollout_worker.cli.check import has_solution

    rows = [["ID", "STATEMENT", "WORKSPACE", "TESTS", "SOLUTION", "LIMIT"]]
    for task in task_list:
        statement = str(task.get("statement") or "").strip()
        first = statement.splitlines()[0] if statement else ""
        if len(first) > 60:
            first = first[:57] + "..."
        files = len(task.get("files") or {})
        plural = "" if files == 1 else "s"
        workspace = f"image {task['image']}" if task.get("image") else f"{files} file{plural}"
        tests = len(task.get("tests") or task.get("test_files") or {})
        limit = task.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS)
        rows.append(
            [
                str(task.get("id")),
                first,
                workspace,
                str(tests),
                "yes" if has_solution(task) else "no",
                f"{limit}s",
            ]
        )
    return rows


def format_rows(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


@tasks.command()
@click.argument("ref")
@click.option("--task", "only", multiple=True, help="Only this task id (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="The tasks as JSON (what a batch carries).")
@allow_unknown_keys_option
def show(ref: str, only: tuple[str, ...], as_json: bool, allow_unknown_keys: bool) -> None:
    """The tasks of REF: a Harbor task folder, a JSON task set, or "bundled"."""
    import orjson

    from rollout_wire.tasksets import load_task_set

    try:
        with task_warnings_printed():
            loaded = load_task_set(ref, list(only) or None, allow_unknown_keys)
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    if as_json:
        click.echo(orjson.dumps(loaded, option=orjson.OPT_INDENT_2).decode())
        return
    for line in format_rows(summary_rows(loaded)):
        click.echo(line)


@tasks.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--task", "only", multiple=True, help="Only this task id (repeatable).")
@click.option(
    "--node-import",
    is_flag=True,
    help="Load each image into the local cluster's real node (its containerd, k8s.io).",
)
@click.option(
    "--containerd-socket",
    "socket_path",
    default=None,
    help="For --node-import. [default: hack/localkube's, from ROLLOUT_NODE_CONTAINERD_STATE / "
    "ROLLOUT_LOCALKUBE_NODE_ID]",
)
@click.option(
    "--push",
    "registry",
    default=None,
    metavar="REGISTRY",
    help="Tag and push each image as REGISTRY/<name>:<tag> (prints the names).",
)
@click.option(
    "--rootfs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Extract each image's root filesystem under this folder (for the local backend).",
)
@click.option("--dry-run", is_flag=True, help="Print the commands; run nothing.")
@allow_unknown_keys_option
def build(
    folder: Path,
    only: tuple[str, ...],
    node_import: bool,
    socket_path: str | None,
    registry: str | None,
    rootfs: Path | None,
    dry_run: bool,
    allow_unknown_keys: bool,
) -> None:
    """Build the image of every Harbor task in FOLDER that has an environment/Dockerfile."""
    from rollout_wire import harbor

    try:
        mapped = harbor.scan(folder, list(only) or None, allow_unknown_keys)
        print_task_warnings(w for h in mapped for w in h.warnings)
        node_socket = (socket_path or containerd_socket()) if node_import else None
        if registry is not None:
            check_registry(registry)  # before anything is built
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    for h in mapped:
        if h.build_dir is None and h.task.get("image"):
            click.echo(f"{h.task_id}: uses the prebuilt image {h.task['image']} (nothing to build)")
    images = [(str(h.task["image"]), h.task_id, h.build_dir) for h in mapped if h.build_dir]
    if not images:
        click.echo(f"no task in {folder} has an environment/Dockerfile: nothing to build")
        return
    if rootfs is not None:
        rootfs = rootfs.resolve()
    if dry_run:
        for step in plan(images, node_socket=node_socket, registry=registry, rootfs=rootfs):
            click.echo(step.text())
        return
    problems = preflight(node_socket)
    if problems:
        _problems_exit(problems)
    failures = build_images(images, node_socket=node_socket, registry=registry, rootfs=rootfs)
    if failures:
        _problems_exit(failures)


@tasks.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--task", "only", multiple=True, help="Only this task id (repeatable).")
@click.option("--nop", is_flag=True, help="Also run an agent that does nothing: it must score 0.")
@click.option(
    "--allow-no-oracle",
    is_flag=True,
    help="A task without solution/solve.sh passes (shown as 'no oracle'). [default: it fails]",
)
@click.option(
    "--backend",
    type=click.Choice(["local", "kubernetes"]),
    default="local",
    show_default=True,
    help="Where the episodes run.",
)
@click.option(
    "--all-in-one/--no-all-in-one",
    default=None,
    help="Start a private redis-server and workers for the check. [default: on for local; "
    "off for kubernetes, which uses the workers at --redis-url]",
)
@click.option(
    "--rootfs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Local backend: where the images' root filesystems are exported. "
    "[default: ROLLOUT_ROOTFS_DIR, else the workers' default]",
)
@click.option(
    "--node-import",
    is_flag=True,
    help="Kubernetes: load each built image into the local cluster's real node.",
)
@click.option(
    "--episode-timeout",
    "episode_timeout_seconds",
    type=int,
    default=None,
    help="Seconds one episode may take. [default: the longest task's limit + 60, at least 120]",
)
@placement.options
@redis_option
@allow_unknown_keys_option
def check(
    folder: Path,
    only: tuple[str, ...],
    nop: bool,
    allow_no_oracle: bool,
    backend: str,
    all_in_one: bool | None,
    rootfs: Path | None,
    node_import: bool,
    episode_timeout_seconds: int | None,
    redis_url: str | None,
    placement: dict[str, Any],
    allow_unknown_keys: bool,
) -> None:
    """Check a Harbor task set before training on it: build what needs building, run every
    task's oracle (solution/solve.sh, which must score 1) and with --nop an agent that does
    nothing (which must score 0), and print a table. Exit status 1 when a task fails, 3 when
    only infrastructure failures kept tasks from being judged."""
    from rollout_wire import harbor
    from rollout_worker.cli import check as verdict

    settings = load_settings(redis_url)
    if all_in_one is None:
        all_in_one = backend == "local"
    try:
        mapped = harbor.scan(folder, list(only) or None, allow_unknown_keys)
        print_task_warnings(w for h in mapped for w in h.warnings)
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    task_list = [h.task for h in mapped]
    images = [(str(h.task["image"]), h.task_id, h.build_dir) for h in mapped if h.build_dir]
    build_errors: dict[str, str] = {}
    if backend == "local":
        rootfs = (rootfs or settings.rootfs_dir).resolve()
    if images:
        node_socket = containerd_socket() if node_import else None
        problems = preflight(node_socket)
        if problems:
            _problems_exit(problems)
        if rootfs is not None and not rootfs.exists():
            rootfs.mkdir(parents=True)
            rootfs.chmod(0o755)  # the sandboxes run as another host user
        failures = build_images(
            images,
            node_socket=node_socket,
            registry=None,
            rootfs=rootfs if backend == "local" else None,
            echo=lambda line: click.echo(line, err=True),
        )
        for line in failures:
            task_id, _, why = line.partition(": ")
            build_errors[task_id] = why
            click.echo(f"error: {line}", err=True)
    runnable = [t for t in task_list if str(t["id"]) not in build_errors]
    episode_timeout, deadline = verdict.limits(runnable)
    if episode_timeout_seconds is not None:
        episode_timeout = episode_timeout_seconds
        deadline = max(deadline, episode_timeout + verdict.DEADLINE_MARGIN_SECONDS)
    requests = {}
    common = {
        "backend": backend,
        "episode_timeout_seconds": episode_timeout,
        "deadline_seconds": deadline,
        **placement,
    }
    stated = [h.requirements for h in mapped if h.task_id not in build_errors]
    if limits := verdict.resources(stated):
        common["resources"] = limits
    if oracle_list := verdict.oracle_tasks(runnable):
        requests["oracle"] = common | {"tasks": oracle_list}
    if nop and runnable:
        nop_list = verdict.nop_tasks(runnable)
        requests["nop"] = common | {"tasks": nop_list, "policy": verdict.NEVER_ASKED_POLICY}
    reports = _run_check_batches(requests, settings, all_in_one, rootfs)
    checks = verdict.collect(task_list, reports.get("oracle"), reports.get("nop"), build_errors)
    for line in format_rows(verdict.table(checks, nop=nop, allow_no_oracle=allow_no_oracle)):
        click.echo(line)
    click.echo(verdict.summary(checks, allow_no_oracle=allow_no_oracle))
    sys.exit(verdict.exit_status(checks, allow_no_oracle=allow_no_oracle))


def _run_check_batches(
    requests: Mapping[str, Mapping[str, Any]],
    settings: Any,
    all_in_one: bool,
    rootfs: Path | None,
) -> dict[str, dict[str, Any]]:
    """Submit the check's batches at once (they run side by side) and wait for their
    reports: {"oracle": report, "nop": report}."""
    from rollout_wire.errors import RolloutError
    from rollout_wire.states import Cleanup
    from rollout_wire.urls import redacted
    from rollout_worker.cli.common import console, err
    from rollout_worker.cli.stack import LocalStack
    from trainer_stub.client import RolloutClient
    from trainer_stub.display import follow

    if not requests:
        return {}
    try:
        specs = {
            name: RolloutClient.prepare(request, settings.max_batch_episodes)
            for name, request in requests.items()
        }
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    timeout = max(spec.deadline_seconds for spec in specs.values()) + 300
    with contextlib.ExitStack() as stack:
        heartbeat = None
        if all_in_one:
            env = {"ROLLOUT_ROOTFS_DIR": str(rootfs)} if rootfs is not None else {}
            local = stack.enter_context(LocalStack(collectors=1, extra_env=env))
            settings = settings.with_redis(local.redis_url)
            heartbeat = local.check_alive
            err(f"all-in-one: redis {redacted(local.redis_url)}, workers' logs in {local.dir}")
        try:
            client = stack.enter_context(contextlib.closing(RolloutClient(settings.redis_url)))
            sent = {name: client.send(spec) for name, spec in specs.items()}
            for name, submission in sent.items():
                err(f"{name}: batch {submission.batch_id}, {submission.spec.count} episodes")
            by_id = follow(client, list(sent.values()), console(True), timeout, heartbeat)
            if all_in_one:
                scheduled = [
                    s
                    for s in sent.values()
                    if by_id[s.batch_id].get("cleanup") == Cleanup.SCHEDULED
                ]
                _wait_for_cleanups(scheduled, heartbeat)
        except RolloutError as exc:
            raise click.ClickException(str(exc)) from exc
    return {name: by_id[submission.batch_id] for name, submission in sent.items()}


def _wait_for_cleanups(submissions: Sequence[Any], heartbeat: Any) -> None:
    """Before a private stack stops: let its workers delete the runs whose cleanup the report
    scheduled (bounded), as `rollout run --all-in-one` does, so no sandbox's files are left
    for the stack to remove."""
    import time

    from rollout_wire.states import Cleanup
    from rollout_worker.cli.common import CLEANUP_WAIT_SECONDS

    deadline = time.monotonic() + CLEANUP_WAIT_SECONDS
    waiting = list(submissions)
    while waiting and time.monotonic() < deadline:
        waiting = [
            s
            for s in waiting
            if s.receipt().get("cleanup") not in (Cleanup.DELETED, Cleanup.FAILED)
        ]
        if heartbeat is not None:
            heartbeat()
        time.sleep(0.2)
