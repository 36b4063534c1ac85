"""`rollout`: run batches, start workers, check a deployment, clean up runs.

Sits on top of both sides (the trainer's client and the workers). `rollout worker` processes
load neither rich nor matplotlib: every command imports what it needs when it runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson

from rollout_wire import constants as k
from rollout_wire.errors import InvalidSpec, RolloutError
from rollout_wire.request import (
    ACTIONS,
    BACKENDS,
    DEFAULT_DEADLINE_SECONDS,
    DEFAULT_IMAGE,
    DEFAULT_RUNTIME,
)
from rollout_worker.settings import SETTINGS_DOC, Settings

if TYPE_CHECKING:
    from rich.console import Console

    from rollout_wire.request import BatchSpec
    from trainer_stub.client import RolloutClient, Submission

# After its report, --all-in-one waits this long for its run to be deleted.
CLEANUP_WAIT_SECONDS = 120.0
# After the report, --output waits this long for the run's records (they follow the report).
RECORDS_WAIT_SECONDS = 60.0


@functools.cache
def _console(stderr: bool) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=stderr)


def out(*args: Any, **kwargs: Any) -> None:
    _console(False).print(*args, **kwargs)


def err(*args: Any, **kwargs: Any) -> None:
    _console(True).print(*args, **kwargs)


redis_option = click.option(
    "--redis-url",
    envvar="ROLLOUT_REDIS_URL",
    default=None,
    help="Redis URL (broker, results, reports). [env ROLLOUT_REDIS_URL]",
)


def _settings(redis_url: str | None) -> Settings:
    try:
        settings = Settings.from_env()
    except RolloutError as exc:
        raise click.UsageError(str(exc)) from exc
    return settings.with_redis(redis_url) if redis_url else settings


class LazyGroup(click.Group):
    """Commands whose modules load only when that command runs (`report` needs matplotlib)."""

    lazy = {"report": "rollout_worker.report_cmd:report"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Sandboxed RL rollout batches through Celery + Redis."""


@cli.command()
@click.option("--count", type=int, default=10, show_default=True, help="Episodes in the batch.")
@click.option(
    "--parallelism", type=int, default=None, help="Episodes running at once. [default: count]"
)
@click.option("--backend", type=click.Choice(BACKENDS), default="local", show_default=True)
@click.option(
    "--image", default=DEFAULT_IMAGE, show_default=True, help="Sandbox image (kubernetes backend)."
)
@click.option(
    "--runtime",
    default=DEFAULT_RUNTIME,
    show_default=True,
    help="RuntimeClass (kubernetes backend).",
)
@click.option(
    "--deadline",
    "deadline_seconds",
    type=int,
    default=DEFAULT_DEADLINE_SECONDS,
    show_default=True,
    help="Seconds the whole run may take.",
)
@click.option(
    "--episode-timeout",
    "episode_timeout_seconds",
    type=int,
    default=None,
    help="Seconds one episode may take. [default: min(120, deadline)]",
)
@click.option("--cpu-limit", default="500m", show_default=True)
@click.option("--memory-limit", default="128Mi", show_default=True)
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
    "--capacity-check",
    type=click.Choice(["error", "warn", "off"]),
    default="error",
    show_default=True,
    help="What to do when the cluster lacks room (kubernetes).",
)
@click.option(
    "--node-selector",
    multiple=True,
    metavar="KEY=VALUE",
    help="Node label the sandboxes require (kubernetes; repeatable).",
)
@click.option(
    "--toleration",
    multiple=True,
    metavar="KEY[=VALUE]:EFFECT",
    help="Taint the sandboxes tolerate (kubernetes; repeatable).",
)
@click.option(
    "--image-pull-policy",
    type=click.Choice(["IfNotPresent", "Never", "Always"]),
    default="IfNotPresent",
    show_default=True,
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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--tasks",
    "task_set",
    default=None,
    metavar="FILE|bundled",
    help="Real rollouts: a task set (JSON file, or 'bundled'); count = tasks x --samples.",
)
@click.option("--task", "only_tasks", multiple=True, help="Only this task of --tasks (repeatable).")
@click.option("--samples", type=int, default=None, help="Samples per task (group size).")
@click.option("--policy-url", default=None, help="The policy's chat completions server root.")
@click.option("--model", default=None, help="Model name sent to the policy.")
@click.option(
    "--sampling", multiple=True, metavar="KEY=VALUE", help="Sampling parameter (repeatable)."
)
@click.option("--policy-timeout", type=float, default=None, help="Seconds per policy request.")
@redis_option
def run(
    count: int,
    parallelism: int | None,
    backend: str,
    image: str,
    runtime: str,
    deadline_seconds: int,
    episode_timeout_seconds: int | None,
    cpu_limit: str,
    memory_limit: str,
    action: str,
    output: Path | None,
    keep: bool | None,
    capacity_check: str,
    node_selector: tuple[str, ...],
    toleration: tuple[str, ...],
    image_pull_policy: str,
    all_in_one: bool,
    collectors: int,
    timeout: float | None,
    as_json: bool,
    task_set: str | None,
    only_tasks: tuple[str, ...],
    samples: int | None,
    policy_url: str | None,
    model: str | None,
    sampling: tuple[str, ...],
    policy_timeout: float | None,
    redis_url: str | None,
) -> None:
    """Run one batch of episodes through the pipeline and print its report.

    Without --tasks: COUNT episodes of the guide's demo task with its fixed --action. With
    --tasks and --policy-url: every task x --samples, the policy choosing the actions."""
    from rollout_worker.quantities import resource_problems
    from rollout_worker.stack import LocalStack
    from trainer_stub.client import RolloutClient
    from trainer_stub.records import check_output_dir

    settings = _settings(redis_url)
    request: dict[str, Any] = {
        "count": count,
        "parallelism": parallelism,
        "backend": backend,
        "image": image,
        "runtime": runtime,
        "deadline_seconds": deadline_seconds,
        "action": action,
        "resources": {"cpu_limit": cpu_limit, "memory_limit": memory_limit},
        "keep_run": keep if keep is not None else (backend == "kubernetes" and bool(output)),
        "capacity_check": capacity_check,
        "image_pull_policy": image_pull_policy,
        "node_selector": dict(_pair(item, "--node-selector") for item in node_selector),
        "tolerations": [_toleration(item) for item in toleration],
    }
    if episode_timeout_seconds is not None:
        request["episode_timeout_seconds"] = episode_timeout_seconds
    try:
        from rollout_wire.tasksets import parse_sampling, rollout_fields

        request |= rollout_fields(
            tasks=task_set,
            only=only_tasks,
            samples=samples,
            policy_url=policy_url,
            model=model,
            sampling=parse_sampling(sampling),
            policy_timeout=policy_timeout,
        )
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    source = click.get_current_context().get_parameter_source("count")
    if task_set is not None and source == click.core.ParameterSource.DEFAULT:
        del request["count"]  # the task set times the samples decides
    if collectors < 1:
        raise click.UsageError("--collectors must be at least 1")
    try:
        # The one parse of this request in this process; the workers parse it at their edge.
        spec = RolloutClient.prepare(request, settings.max_batch_episodes)
        problems = resource_problems(spec.resources)
        if problems:
            raise InvalidSpec(problems)
        if output is not None:
            check_output_dir(output)
    except InvalidSpec as exc:
        raise click.UsageError("\n  ".join(["invalid batch:", *exc.problems])) from exc
    except RolloutError as exc:
        raise click.UsageError(str(exc)) from exc

    with contextlib.ExitStack() as stack:
        heartbeat = None
        if all_in_one:
            local = stack.enter_context(LocalStack(collectors=collectors))
            settings = settings.with_redis(local.redis_url)
            heartbeat = local.check_alive
            err(
                f"all-in-one: redis {local.redis_url}, 1 control + {collectors} collect "
                f"workers (logs in {local.dir})"
            )
        client = stack.enter_context(contextlib.closing(RolloutClient(settings.redis_url)))
        try:
            submission, report = _submit_and_wait(
                client, spec, output, timeout or deadline_seconds + 300, heartbeat
            )
            if all_in_one and report.get("cleanup") == "scheduled":
                _wait_for_cleanup(client, spec.batch_id, heartbeat)
        except RolloutError as exc:
            raise click.ClickException(str(exc)) from exc
    _print_report(report, submission, as_json)
    sys.exit(0 if report.get("ok") else 1)


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


def _submit_and_wait(
    client: RolloutClient,
    spec: BatchSpec,
    output: Path | None,
    timeout: float,
    heartbeat: Any,
) -> tuple[Submission, dict[str, Any]]:
    from trainer_stub.display import follow
    from trainer_stub.records import start_records, write_receipt, write_records

    batch_id = spec.batch_id
    beat = _hint_if_unclaimed(client, batch_id, heartbeat)
    if output is not None:
        # The directory and its receipt exist before anything is sent; the receipt then
        # follows the workers' one, so it names every object even if this client dies.
        start_records(
            output,
            {
                "batch_id": batch_id,
                "backend": spec.backend,
                "redis_key": k.receipt_key(batch_id),
                "state": "submitting",
            },
        )
        beat = _mirror_receipt(client, batch_id, output, beat)
    submission = client.send(spec)
    err(f"batch {batch_id}: {spec.count} episodes submitted")
    report = follow(client, [submission], _console(True), timeout, beat)[batch_id]
    if output is not None:
        _wait_for_records(client, batch_id, report)
        write_records(
            output,
            report,
            client.logs(batch_id),
            client.records(batch_id),
            submission.submit_to_report_seconds,
        )
        write_receipt(output, client.receipt(batch_id) | {"state": "reported"})
        err(f"records written to {output}/")
    return submission, report


def _mirror_receipt(client: RolloutClient, batch_id: str, output: Path, inner: Any) -> Any:
    """Keep receipt.json in step with the Redis receipt while the run is created, so the
    directory names every object (namespace, UIDs) even if this client dies mid-run."""
    from trainer_stub.records import write_receipt

    last: dict[str, Any] = {}

    def beat() -> None:
        nonlocal last
        inner()
        receipt = client.receipt(batch_id)
        if receipt and receipt != last:
            write_receipt(output, receipt | {"state": "running"})
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


def _wait_for_records(client: RolloutClient, batch_id: str, report: dict[str, Any]) -> None:
    """The report comes first; the run's records (job.json, ...) follow within seconds."""
    if report.get("records") != "pending":
        return
    deadline = time.monotonic() + RECORDS_WAIT_SECONDS
    while client.receipt(batch_id).get("records") == "pending" or not client.receipt(batch_id).get(
        "records"
    ):
        if time.monotonic() > deadline:
            err(f"[yellow]records of batch {batch_id} not complete; writing what exists[/yellow]")
            return
        time.sleep(0.2)


def _wait_for_cleanup(client: RolloutClient, batch_id: str, heartbeat: Any) -> None:
    """Before a private stack stops: wait (bounded) for the workers to delete the run."""
    deadline = time.monotonic() + CLEANUP_WAIT_SECONDS
    state = None
    while time.monotonic() < deadline:
        state = client.receipt(batch_id).get("cleanup")
        if state in ("deleted", "failed"):
            break
        if heartbeat is not None:
            heartbeat()
        time.sleep(0.2)
    if state not in ("deleted", "failed"):
        err(
            f"[yellow]run of batch {batch_id} still {state} after "
            f"{CLEANUP_WAIT_SECONDS:.0f}s; stopping anyway (`rollout sweep` finds it)[/yellow]"
        )
    elif state == "failed":
        err(f"[red]run of batch {batch_id} was not deleted: see the worker log[/red]")


def _print_report(report: dict[str, Any], submission: Submission, as_json: bool) -> None:
    from rollout_worker.report import summary
    from trainer_stub.display import print_errors, summary_table

    if as_json:
        text = summary(report) | {
            "client_submit_to_report_seconds": submission.submit_to_report_seconds
        }
        sys.stdout.write(orjson.dumps(text, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    out(summary_table([report], [submission]))
    print_errors(_console(True), report)


@cli.command()
@click.option(
    "--queues",
    "-Q",
    default=k.QUEUE_CONTROL,
    show_default=True,
    help=f"Comma-separated queues: {', '.join(k.QUEUES)}.",
)
@click.option(
    "--concurrency",
    "-c",
    type=int,
    default=None,
    help="Worker slots. [default: 2 for control, 100 for collect: each waits cheaply]",
)
@click.option(
    "--pool",
    type=click.Choice(["prefork", "threads", "solo"]),
    default=None,
    help="[default: prefork for control, threads for collect (I/O-bound waits)]",
)
@click.option("--hostname", "-n", default=None, help="Worker node name (Celery -n).")
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@click.option("--events/--no-events", default=False, help="Send task events (for Flower).")
@click.option(
    "--beat",
    is_flag=True,
    help="Also run the periodic sweeper (ROLLOUT_SWEEP_SECONDS); one per deployment.",
)
@redis_option
def worker(
    queues: str,
    concurrency: int | None,
    pool: str | None,
    hostname: str | None,
    loglevel: str,
    events: bool,
    beat: bool,
    redis_url: str | None,
) -> None:
    """Start a Celery worker for the given queues."""
    from rollout_worker.celery_app import create_app

    names = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(names) - set(k.QUEUES))
    if not names or unknown:
        raise click.UsageError(f"unknown queue(s) {unknown}; choose from {list(k.QUEUES)}")
    collect_only = names == [k.QUEUE_COLLECT]
    pool = pool or ("threads" if collect_only else "prefork")
    concurrency = concurrency or (100 if collect_only else 2)
    if concurrency < 1:
        raise click.UsageError("--concurrency must be at least 1")
    app = create_app(_settings(redis_url))
    argv = [
        "worker",
        "-Q",
        ",".join(names),
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-l",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]
    if hostname:
        argv += ["-n", hostname]
    if events:
        argv.append("-E")
    if beat:
        import tempfile

        schedule = Path(tempfile.gettempdir()) / f"rollout-beat-{hostname or 'worker'}"
        argv += ["-B", "--schedule", str(schedule)]
    app.worker_main(argv)


@cli.command()
@click.argument("batch_id")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the report.")
@click.option("--timeout", type=float, default=120, show_default=True)
@redis_option
def cancel(batch_id: str, wait: bool, timeout: float, redis_url: str | None) -> None:
    """Stop a running batch: its sandboxes stop, its report says `cancelled`."""
    from trainer_stub.client import RolloutClient

    client = RolloutClient(_settings(redis_url).redis_url)
    try:
        if not client.receipt(batch_id):
            raise click.ClickException(f"no batch {batch_id} in this Redis")
        client.cancel(batch_id)
        if not wait:
            out(f"cancel of batch {batch_id} sent")
            return
        report = client.wait(batch_id, timeout)
    except RolloutError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        client.close()
    out(
        f"batch {batch_id}: {report.get('status')}, {report.get('successful_episodes')} of "
        f"{report.get('episodes')} episodes had finished ok"
    )


@cli.command()
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@redis_option
def sweep(dry_run: bool, redis_url: str | None) -> None:
    """Delete runs of ours that nothing else will (the sweeper that `--beat` runs)."""
    from rollout_worker import core
    from rollout_worker.backends import get_backend
    from rollout_worker.store import Store
    from rollout_worker.tasks import sweep_backends

    settings = _settings(redis_url)
    store = Store.from_url(settings.redis_url, settings.record_ttl)
    backends: dict[str, Any] = {}

    def backend_for(name: str) -> Any:
        if name not in backends:
            backends[name] = get_backend(name, settings)
        return backends[name]

    try:
        swept = core.sweep(
            store,
            backend_for,
            sweep_backends(settings),
            run_ttl=settings.run_ttl_seconds,
            now=time.time(),
            dry_run=dry_run,
        )
    except RolloutError as exc:
        raise click.ClickException(str(exc)) from exc
    for item in swept:
        out(f"{item.action:12} {item.batch_id}  {item.reason}", highlight=False)
    if not swept:
        out("nothing to sweep")


@cli.command()
@redis_option
@click.option("--timeout", type=float, default=3.0, show_default=True)
@click.option(
    "--kubernetes/--no-kubernetes",
    "check_cluster",
    default=None,
    help="Also check the cluster, the RuntimeClass and the workers' permissions. "
    "[default: when KUBECONFIG is set or in a Pod]",
)
@click.option("--runtime", default=DEFAULT_RUNTIME, show_default=True)
def check(redis_url: str | None, timeout: float, check_cluster: bool | None, runtime: str) -> None:
    """Ping Redis, list live workers per queue and (when configured) check the cluster and the
    RuntimeClass; exit 1 with what is missing."""
    import redis as redis_lib

    from rollout_worker.celery_app import create_app

    settings = _settings(redis_url)
    problems = []
    try:
        redis_lib.Redis.from_url(settings.redis_url, socket_timeout=timeout).ping()
        out(f"redis: ok ({settings.redis_url})")
    except redis_lib.RedisError as exc:
        raise click.ClickException(
            f"redis at {settings.redis_url} is not reachable: {exc}"
        ) from exc
    app = create_app(settings, with_tasks=False)
    replies = app.control.inspect(timeout=timeout).active_queues() or {}
    per_queue: dict[str, list[str]] = {q: [] for q in k.QUEUES}
    for node, queues in sorted(replies.items()):
        for queue in queues:
            per_queue.setdefault(queue["name"], []).append(node)
    for queue, nodes in per_queue.items():
        out(f"queue {queue}: {len(nodes)} worker(s) {', '.join(nodes)}")
        if not nodes:
            problems.append(
                f"no worker consumes queue {queue!r} (start `rollout worker -Q {queue}`)"
            )
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))  # a Pod: in-cluster config
    if check_cluster or (check_cluster is None and (settings.kubeconfig or in_cluster)):
        from rollout_worker.backends.kubernetes import KubernetesBackend
        from rollout_worker.permissions import cluster_check

        try:
            # One line per permission (SelfSubjectAccessReview): granted or denied.
            found, missing = cluster_check(KubernetesBackend(settings), runtime)
        except RolloutError as exc:
            found, missing = [], [f"cluster not usable: {exc}"]
        for line in found:
            out(line, highlight=False)
        problems += missing
    for problem in problems:
        err(f"[red]missing[/red] {problem}")
    sys.exit(1 if problems else 0)


@cli.command()
@click.option(
    "--output",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="The records directory of the run (holds receipt.json).",
)
def cleanup(output: Path) -> None:
    """Delete a kept run, after proving from its receipt that we created it."""
    from rollout_worker.backends import RunHandle, get_backend
    from rollout_worker.backends.kube_read import handle_from_receipt

    receipt_file = output / "receipt.json"
    if not receipt_file.exists():
        raise click.UsageError(f"{receipt_file} does not exist")
    receipt = orjson.loads(receipt_file.read_bytes())
    run = receipt.get("run")
    # A run cut short before its handle was recorded: the receipt's first fields prove it.
    handle = RunHandle.from_dict(run) if isinstance(run, dict) else handle_from_receipt(receipt)
    if handle is None:
        raise click.ClickException(f"{receipt_file} records no run: nothing was created")
    # Every call goes to the cluster the run was created in, whatever the current context is.
    settings = _settings(None)
    if handle.backend == "kubernetes":
        settings = replace(settings, kube_context=handle.context)
    deadline = time.monotonic() + CLEANUP_WAIT_SECONDS
    try:
        backend = get_backend(handle.backend, settings)
        while not backend.delete_run(handle):
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"run of batch {receipt.get('batch_id')} still being deleted after "
                    f"{CLEANUP_WAIT_SECONDS:.0f}s; inspect its finalizers (never force-removed)"
                )
            time.sleep(1)
    except RolloutError as exc:
        raise click.ClickException(str(exc)) from exc
    out(f"deleted run of batch {receipt.get('batch_id')}")


@cli.command("policy-server")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--script",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Extra scripted tasks (JSON {'tasks': {id: {'plans': [[turn, ...]]}}}).",
)
@click.option(
    "--hang-seconds", type=float, default=30.0, show_default=True, help="A scripted 'hang'."
)
@click.option("--verbose", is_flag=True, help="Log every request.")
def policy_server(
    host: str, port: int, script: Path | None, hang_seconds: float, verbose: bool
) -> None:
    """Serve the scripted policy (OpenAI-compatible chat completions, no GPU) for the bundled
    task set: right and wrong fixes, malformed, slow and timed-out replies."""
    from rollout_worker.policy_server import PolicyServer, load_script

    server = PolicyServer(host, port, load_script(script), hang_seconds, verbose)
    err(f"scripted policy on {server.url} (episodes call {server.url}/rollout/<id>/v1)")
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


@cli.command()
def settings() -> None:
    """List the environment variables that configure workers and clients."""
    for name, doc in SETTINGS_DOC.items():
        out(f"[bold]{name}[/bold]: {doc}", highlight=False)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
