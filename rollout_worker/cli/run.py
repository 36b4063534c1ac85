"""`rollout run`: one batch through the pipeline, its live progress, its records and report.

Loaded only when the command runs (it pulls in rich and the trainer's client).
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson

from rollout_wire import constants as k
from rollout_wire.errors import InvalidSpec, RolloutError, TaskWarning
from rollout_wire.request import (
    ACTIONS,
    BACKENDS,
    DEFAULT_DEADLINE_SECONDS,
)
from rollout_wire.resources import DEFAULT_STORAGE_LIMIT
from rollout_wire.states import Cleanup, Records
from rollout_wire.tasksets import DEADLINE_MARGIN_SECONDS, SETUP_MARGIN_SECONDS, task_limits
from rollout_wire.urls import redacted
from rollout_worker.cli import placement
from rollout_worker.cli.common import (
    CLEANUP_WAIT_SECONDS,
    allow_unknown_keys_option,
    console,
    err,
    load_settings,
    out,
    print_task_warnings,
    redis_option,
)
from trainer_stub import options

if TYPE_CHECKING:
    from rollout_wire.request import BatchSpec
    from rollout_worker.settings import Settings
    from trainer_stub.client import RolloutClient, Submission

DEFAULT_CPU_LIMIT = "500m"
DEFAULT_MEMORY = "128Mi"
DEFAULT_STORAGE = DEFAULT_STORAGE_LIMIT
# After the report, --output waits this long for the run's records (they follow the report).
RECORDS_WAIT_SECONDS = 60.0


@click.command()
@options.count("Episodes in the batch.")
@options.parallelism("Episodes running at once. [default: count]")
@options.backend(BACKENDS)
@placement.options
@click.option(
    "--deadline",
    "deadline_seconds",
    type=int,
    default=None,
    help=f"Seconds the whole run may take. [default: {DEFAULT_DEADLINE_SECONDS}; with --tasks, "
    "what the batch needs: waves of --parallelism episodes x the episode timeout + "
    f"{DEADLINE_MARGIN_SECONDS}]",
)
@click.option(
    "--episode-timeout",
    "episode_timeout_seconds",
    type=int,
    default=None,
    help="Seconds one episode may take. [default: min(120, deadline); with --tasks, the "
    "slowest task's agent limit + test limit(s) + "
    f"{SETUP_MARGIN_SECONDS}, at least 120]",
)
@click.option(
    "--cpu-limit",
    default=None,
    help="CPU limit of each sandbox. [default: 500m, or the largest [environment] cpus of "
    "the Harbor tasks]",
)
@click.option(
    "--memory-limit",
    default=None,
    help="Memory limit of each sandbox. [default: 128Mi, or the largest [environment] "
    "memory_mb of the Harbor tasks]",
)
@click.option(
    "--storage-limit",
    default=None,
    help=f"Disk limit of each episode (its workspace and other on-disk folders); past it the "
    f"episode fails as its own. [default: {DEFAULT_STORAGE}, or the largest [environment] "
    "storage_mb of the Harbor tasks]",
)
@allow_unknown_keys_option
@click.option(
    "--action",
    type=click.Choice(ACTIONS),
    default="fix",
    show_default=True,
    help="The episode's action: fix (the demo agent), none (a failing episode), "
    "hang (never finishes).",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for the records (results.json, logs, receipt.json); must not exist.",
)
@click.option(
    "--keep/--no-keep",
    default=None,
    help="Keep the run after the report, for `rollout cleanup --output`. "
    "[default: keep on kubernetes when --output is given, else delete]",
)
@click.option(
    "--all-in-one",
    is_flag=True,
    help="Start a private redis-server and workers for this run, stop them after.",
)
@click.option(
    "--collectors",
    type=int,
    default=2,
    show_default=True,
    help="Collect workers started by --all-in-one.",
)
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Seconds to wait for the report. [default: deadline + 300]",
)
@options.as_json("Print the report as JSON.")
@options.tasks("Real rollouts: a task set (JSON file, or 'bundled'); count = tasks x --samples.")
@options.only_tasks("Only this task of --tasks (repeatable).")
@options.samples("Samples per task (group size).")
@options.policy_url()
@options.model()
@options.sampling("Sampling parameter (repeatable).")
@click.option("--policy-timeout", type=float, default=None, help="Seconds per policy request.")
@options.infra_retries(
    "Run an episode that failed for infrastructure reasons again, in a fresh sandbox, "
    "at most this many times. [default: 0]"
)
@options.groups_wanted()
@options.group_filter()
@click.option(
    "--agent",
    default=None,
    metavar="COMMAND|oracle",
    help="Run this command as the agent in each sandbox instead of the built-in loop (it "
    "reaches the policy at $OPENAI_BASE_URL, README: Bring your own agent); 'oracle' runs "
    "each task's solution/solve.sh.",
)
@click.option(
    "--agent-env",
    type=click.Path(exists=True, file_okay=False, resolve_path=True),
    default=None,
    help="Local backend: a folder (a virtual environment holding the agent) shown read-only "
    "to the sandboxes at the same path. --all-in-one allows it for its workers; other workers "
    "need it in ROLLOUT_AGENT_ENVS.",
)
@click.option(
    "--task-env-secret",
    default=None,
    metavar="NAME",
    help="Kubernetes: the Secret (in the batch's namespace) whose keys give the tasks' "
    "${VAR} templates ([environment.env], [verifier.env], [solution.env]) their values; the "
    "local backend reads its workers' environment instead.",
)
@click.option(
    "--warm-pool",
    type=int,
    default=0,
    show_default=True,
    help="After this batch, keep this many sandboxes of its shape waiting for the next one "
    "(README: Warm sandboxes).",
)
@redis_option
def run(**given: Any) -> None:
    """Run one batch of episodes through the pipeline and print its report.

    Without --tasks: COUNT episodes of the guide's demo task with its fixed --action. With
    --tasks and --policy-url: every task x --samples, the policy choosing the actions."""
    # Its phases: the flags parsed into a request, checked, run (records written with
    # --output), then the report printed.
    flags = RunFlags(**given)
    settings = load_settings(flags.redis_url)
    request = _request(flags)
    spec = _preflight(request, settings, flags)
    submission, report = _submit_in_stack(spec, settings, flags)
    _print_report(report, submission, flags.as_json)
    sys.exit(0 if report.get("ok") else 1)


@dataclass(frozen=True)
class RunFlags:
    """The flags of `rollout run`, as click parsed them (one field per option)."""

    count: int
    parallelism: int | None
    backend: str
    placement: dict[str, Any]
    deadline_seconds: int | None
    episode_timeout_seconds: int | None
    cpu_limit: str | None
    memory_limit: str | None
    storage_limit: str | None
    allow_unknown_keys: bool
    action: str
    output: Path | None
    keep: bool | None
    all_in_one: bool
    collectors: int
    timeout: float | None
    as_json: bool
    task_set: str | None
    only_tasks: tuple[str, ...]
    samples: int | None
    policy_url: str | None
    model: str | None
    sampling: tuple[str, ...]
    policy_timeout: float | None
    infra_retries: int | None
    groups_wanted: int | None
    group_filter: str | None
    agent: str | None
    agent_env: str | None
    task_env_secret: str | None
    warm_pool: int
    redis_url: str | None


def _request(f: RunFlags) -> dict[str, Any]:
    """The batch request the flags describe (a usage error when they describe none)."""
    keep = f.keep if f.keep is not None else (f.backend == "kubernetes" and bool(f.output))
    request: dict[str, Any] = {
        "count": f.count,
        "parallelism": f.parallelism,
        "backend": f.backend,
        "action": f.action,
        "keep_run": keep,
        **f.placement,
    }
    if f.warm_pool:
        request["warm_pool"] = f.warm_pool
    if f.agent is not None:
        request["agent"] = f.agent if f.agent == "oracle" else {"command": shlex.split(f.agent)}
    if f.agent_env is not None:
        request["agent_env"] = f.agent_env
    if f.task_env_secret is not None:
        request["task_env_secret"] = f.task_env_secret
    try:
        from rollout_wire.tasksets import parse_sampling, rollout_fields

        # _limits lists the tasks' warnings once, from the same scan.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TaskWarning)
            request |= rollout_fields(
                tasks=f.task_set,
                only=f.only_tasks,
                samples=f.samples,
                policy_url=f.policy_url,
                model=f.model,
                sampling=parse_sampling(f.sampling),
                policy_timeout=f.policy_timeout,
                infra_retries=f.infra_retries,
                groups_wanted=f.groups_wanted,
                group_filter=f.group_filter,
                allow_unknown_keys=f.allow_unknown_keys,
            )
        source = click.get_current_context().get_parameter_source("count")
        if f.task_set is not None and source == click.core.ParameterSource.DEFAULT:
            del request["count"]  # the task set times the samples decides
        request |= _limits(
            request,
            f.task_set,
            f.only_tasks,
            f.allow_unknown_keys,
            deadline_seconds=f.deadline_seconds,
            episode_timeout_seconds=f.episode_timeout_seconds,
            cpu_limit=f.cpu_limit,
            memory_limit=f.memory_limit,
            storage_limit=f.storage_limit,
        )
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    return request


def _preflight(request: dict[str, Any], settings: Settings, flags: RunFlags) -> BatchSpec:
    """The request parsed into a batch, checked before anything starts: its resources, and an
    --output directory that must not exist yet."""
    from rollout_worker.quantities import resource_problems
    from trainer_stub.client import RolloutClient
    from trainer_stub.records import check_output_dir

    if flags.collectors < 1:
        raise click.UsageError("--collectors must be at least 1")
    try:
        # The one parse of this request in this process; the workers parse it at their edge.
        spec = RolloutClient.prepare(request, settings.max_batch_episodes)
        problems = resource_problems(spec.resources)
        if problems:
            raise InvalidSpec(problems)
        if flags.output is not None:
            check_output_dir(flags.output)
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    except RolloutError as exc:
        raise click.UsageError(str(exc)) from exc
    return spec


def _submit_in_stack(
    spec: BatchSpec, settings: Settings, flags: RunFlags
) -> tuple[Submission, dict[str, Any]]:
    """Send the batch and wait for its report (and its records, with --output), on a private
    stack with --all-in-one, whose workers then delete the run before it stops."""
    from rollout_worker.cli.stack import LocalStack
    from trainer_stub.client import RolloutClient

    with contextlib.ExitStack() as stack:
        heartbeat = None
        if flags.all_in_one:
            local = stack.enter_context(
                LocalStack(
                    collectors=flags.collectors,
                    extra_env={"ROLLOUT_AGENT_ENVS": flags.agent_env} if flags.agent_env else {},
                )
            )
            settings = settings.with_redis(local.redis_url)
            heartbeat = local.check_alive
            err(
                f"all-in-one: redis {redacted(local.redis_url)}, 1 control + {flags.collectors} "
                f"collect workers (logs in {local.dir})"
            )
        try:
            # Every Redis call of this client (the send, the progress, the receipt mirror, the
            # records) waits out an outage up to its limit, then ends here in one line.
            client = stack.enter_context(contextlib.closing(RolloutClient(settings.redis_url)))
            timeout = flags.timeout or spec.deadline_seconds + 300
            submission, report = _submit_and_wait(client, spec, flags.output, timeout, heartbeat)
            if flags.all_in_one and report.get("cleanup") == Cleanup.SCHEDULED:
                _wait_for_cleanup(submission, heartbeat)
        except RolloutError as exc:
            raise click.ClickException(str(exc)) from exc
    return submission, report


def _limits(
    request: dict[str, Any],
    task_set: str | None,
    only: tuple[str, ...],
    allow_unknown_keys: bool,
    *,
    deadline_seconds: int | None,
    episode_timeout_seconds: int | None,
    cpu_limit: str | None,
    memory_limit: str | None,
    storage_limit: str | None = None,
) -> dict[str, Any]:
    """The batch's time and resource limits: a flag the user set wins; else, with --tasks,
    what the tasks state (their timeouts; Harbor's [environment] cpus, memory_mb, storage_mb), else
    the fixed defaults. A flag below what a Harbor task states is refused naming both. Harbor
    keys accepted without being enforced are listed here, before the run."""
    from rollout_worker.quantities import format_memory, parse_quantity

    fields: dict[str, Any] = {}
    tasks = request.get("tasks") or []
    if tasks:
        episodes = request.get("count") or len(tasks) * int(request.get("samples_per_task", 1))
        episode_timeout_seconds, deadline_seconds = task_limits(
            tasks,
            episodes,
            request.get("parallelism"),
            episode_timeout=episode_timeout_seconds,
            deadline=deadline_seconds,
        )
        fields["episode_timeout_seconds"] = episode_timeout_seconds
    elif episode_timeout_seconds is not None:
        fields["episode_timeout_seconds"] = episode_timeout_seconds
    fields["deadline_seconds"] = (
        deadline_seconds if deadline_seconds is not None else DEFAULT_DEADLINE_SECONDS
    )
    # (field, flag, task.toml key, its unit in words, bytes or CPUs per unit, as the flag
    # would say it, the default): the largest a task states is the default, a smaller flag
    # refused by name.
    limits = (
        ("cpu_limit", cpu_limit, "cpus", "CPUs", 1, str, DEFAULT_CPU_LIMIT),
        ("memory_limit", memory_limit, "memory_mb", "MB", 2**20, format_memory, DEFAULT_MEMORY),
        ("storage_limit", storage_limit, "storage_mb", "MB", 2**20, format_memory, DEFAULT_STORAGE),
    )
    wanted = {key: 0 for _, _, key, *_ in limits}
    if task_set is not None and Path(task_set).is_dir():
        from rollout_wire import harbor

        for mapped in harbor.scan(task_set, list(only) or None, allow_unknown_keys):
            print_task_warnings(mapped.warnings)
            for key in wanted:
                wanted[key] = max(wanted[key], mapped.requirements.get(key, 0))
    problems = []
    resources = {}
    for name, given, key, words, unit, shown, default in limits:
        flag = "--" + name.replace("_", "-")
        if given is None:
            given = shown(wanted[key] * unit) if wanted[key] else default
        elif wanted[key] and parse_quantity(given) < wanted[key] * unit:
            problems.append(
                f"{flag} {given} is below the {wanted[key]} {words} a task states "
                f"([environment] {key}): raise {flag} or leave it out"
            )
        resources[name] = given
    if problems:
        raise InvalidSpec(problems)
    fields["resources"] = resources
    return fields


def _submit_and_wait(
    client: RolloutClient,
    spec: BatchSpec,
    output: Path | None,
    timeout: float,
    heartbeat: Any,
) -> tuple[Submission, dict[str, Any]]:
    from trainer_stub.display import follow
    from trainer_stub.records import discard_records, start_records, write_receipt, write_records

    batch_id = spec.batch_id
    beat = _hint_if_unclaimed(client, batch_id, heartbeat)
    if output is not None:
        # The directory and its receipt exist before anything is sent; the receipt then
        # follows the workers' one, so it names every object even if this client dies.
        # What only this client knows (where the workers' receipt lives) stays in every
        # version of the file: the mirrored receipt is merged over it, never replaces it.
        own = {"batch_id": batch_id, "backend": spec.backend, "redis_key": k.receipt_key(batch_id)}
        start_records(output, own | {"state": "submitting"})
        beat = _mirror_receipt(client, batch_id, output, beat, own)
    try:
        submission = client.send(spec)
    except RolloutError:
        # Not sent (Redis unreachable): no directory is left behind to refuse the next try.
        if output is not None:
            discard_records(output)
        raise
    err(f"batch {batch_id}: {spec.count} episodes submitted")
    report = follow(client, [submission], console(True), timeout, beat)[batch_id]
    submission.saw_receipt(report)
    if output is not None:
        receipt = _wait_for_records(submission, report)
        report = _settled(report, receipt)
        write_records(
            output,
            report,
            client.logs(batch_id),
            client.records(batch_id),
            submission.submit_to_report_seconds,
            submission.submit_to_job_complete_seconds,
        )
        write_receipt(output, own | submission.receipt() | {"state": "reported"})
        err(f"records written to {output}/")
    return submission, report


def _mirror_receipt(
    client: RolloutClient, batch_id: str, output: Path, inner: Any, own: dict[str, Any]
) -> Any:
    """Keep receipt.json in step with the Redis receipt while the run is created, so the
    directory names every object (namespace, UIDs) even if this client dies mid-run."""
    from trainer_stub.records import write_receipt

    last: dict[str, Any] = {}

    def beat() -> None:
        nonlocal last
        inner()
        receipt = client.receipt(batch_id)
        if receipt and receipt != last:
            write_receipt(output, own | receipt | {"state": "running"})
            last = receipt

    return beat


def _hint_if_unclaimed(client: RolloutClient, batch_id: str, inner: Any) -> Any:
    started = time.monotonic()
    hinted = False

    def beat() -> None:
        nonlocal hinted
        if inner is not None:
            inner()
        if not hinted and time.monotonic() - started > 15 and not client.receipt(batch_id):
            err(
                "[yellow]no worker has taken the batch yet: is a `rollout worker "
                "--queues control` running against this Redis?[/yellow]"
            )
            hinted = True

    return beat


def _settled(report: dict[str, Any], receipt: dict[str, Any]) -> dict[str, Any]:
    """The report as results.json keeps it: with how the run ended, once its records are in
    (the report itself is published before the Job settles)."""
    completed_at = receipt.get("completed_at")
    if receipt.get("records") != Records.COMPLETE:
        return report
    settled = {"run_verdict": receipt.get("run_verdict"), "completed_at": completed_at}
    if completed_at and report.get("run_created_at"):
        settled["job_complete_seconds"] = completed_at - report["run_created_at"]
    return report | settled


def _wait_for_records(submission: Submission, report: dict[str, Any]) -> dict[str, Any]:
    """The report comes first; the run's records (job.json, ...) and how it ended
    (`completed_at`) follow within seconds in the receipt: read it until they are in
    (bounded), and return it. The read that first shows `completed_at` stops the guide's
    client_job_complete_seconds (polling included, as the guide's client polls the Job)."""
    deadline = time.monotonic() + RECORDS_WAIT_SECONDS
    while True:
        receipt = submission.receipt()
        if report.get("records") != Records.PENDING or receipt.get("records") not in (
            Records.PENDING,
            None,
        ):
            return receipt
        if time.monotonic() > deadline:
            err(
                f"[yellow]records of batch {submission.batch_id} not complete; "
                "writing what exists[/yellow]"
            )
            return receipt
        time.sleep(0.2)


def _wait_for_cleanup(submission: Submission, heartbeat: Any) -> None:
    """Before a private stack stops: wait (bounded) for the workers to delete the run."""
    batch_id = submission.batch_id
    deadline = time.monotonic() + CLEANUP_WAIT_SECONDS
    state = None
    while time.monotonic() < deadline:
        state = submission.receipt().get("cleanup")
        if state in (Cleanup.DELETED, Cleanup.FAILED):
            break
        if heartbeat is not None:
            heartbeat()
        time.sleep(0.2)
    if state not in (Cleanup.DELETED, Cleanup.FAILED):
        err(
            f"[yellow]run of batch {batch_id} still {state} after "
            f"{CLEANUP_WAIT_SECONDS:.0f}s; stopping anyway (`rollout sweep` finds it)[/yellow]"
        )
    elif state == Cleanup.FAILED:
        err(f"[red]run of batch {batch_id} was not deleted: see the worker log[/red]")


def _print_report(report: dict[str, Any], submission: Submission, as_json: bool) -> None:
    from rollout_worker.report import summary
    from trainer_stub.display import group_table, print_errors, summary_table

    if as_json:
        text = summary(report) | {
            "client_submit_to_report_seconds": submission.submit_to_report_seconds,
            "client_job_complete_seconds": submission.submit_to_job_complete_seconds,
        }
        sys.stdout.write(orjson.dumps(text, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    out(summary_table([report], [submission]))
    if report.get("groups") and submission.spec.tasks:
        out(group_table(report))
    print_errors(console(True), report)
