"""`rollout`: the command group. Start workers, cancel a batch, sweep, list or drain warm
pools, check a deployment, clean up a kept run, serve the scripted policy, list the settings;
`run` (`cli/run.py`) and `report` (`cli/report.py`) load only when they run.

Sits on top of both sides (the trainer's client and the workers). `rollout worker` processes
load neither rich nor matplotlib: every command imports what it needs when it runs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import click
import orjson

from rollout_wire import constants as k
from rollout_wire.errors import RolloutError
from rollout_wire.request import DEFAULT_RUNTIME
from rollout_wire.urls import redacted
from rollout_worker.cli.common import CLEANUP_WAIT_SECONDS, err, load_settings, out, redis_option
from rollout_worker.settings import SETTINGS_DOC


class LazyGroup(click.Group):
    """Commands whose modules load only when that command runs (`report` needs matplotlib)."""

    lazy = {
        "report": "rollout_worker.cli.report:report",
        "run": "rollout_worker.cli.run:run",
        "tasks": "rollout_worker.cli.tasks:tasks",
    }

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
@click.option(
    "--events/--no-events", default=False, help="Send task events and heartbeats (for Flower)."
)
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
    app = create_app(load_settings(redis_url))
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
    # Heartbeats go only where someone reads them (Flower): each is a Redis PUBLISH every 2 s
    # per worker, an idle cost paid for as long as the workers run.
    argv.append("-E" if events else "--without-heartbeat")
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

    settings = load_settings(redis_url)
    try:
        # Every Redis call waits out an outage (ROLLOUT_REDIS_OUTAGE_SECONDS), then one line.
        client = RolloutClient(settings.redis_url)
    except RolloutError as exc:
        raise click.UsageError(str(exc)) from exc
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
    import redis as redis_lib

    from rollout_worker import core
    from rollout_worker.backends import Backend, RunHandle, get_backend
    from rollout_worker.core import backend_for_run, sweep_backends
    from rollout_worker.store import Store

    settings = load_settings(redis_url)
    store = Store.from_url(settings.redis_url, settings.record_ttl)
    backends: dict[str, Backend] = {}

    def backend_for(name: str) -> Backend:
        if name not in backends:
            backends[name] = get_backend(name, settings)
        return backends[name]

    def for_run(handle: RunHandle) -> Backend:
        return backend_for_run(handle, settings, backends)

    try:
        swept = core.sweep(
            store,
            backend_for,
            sweep_backends(settings),
            run_ttl=settings.run_ttl_seconds,
            now=time.time(),
            dry_run=dry_run,
            backend_for_run=for_run,
        )
    except RolloutError as exc:
        raise click.ClickException(str(exc)) from exc
    except redis_lib.RedisError as exc:
        raise click.ClickException(
            f"redis at {redacted(settings.redis_url)} is not usable: {exc}"
        ) from exc
    for item in swept:
        out(f"{item.action:12} {item.batch_id}  {item.reason}", highlight=False)
    if not swept:
        out("nothing to sweep")


@cli.command()
@click.option("--drain", is_flag=True, help="Empty every warm pool (waiting sandboxes, then it).")
@click.option(
    "--backend",
    "backend_name",
    type=click.Choice(["local", "kubernetes"]),
    default="kubernetes",
    show_default=True,
)
@redis_option
def pools(drain: bool, backend_name: str, redis_url: str | None) -> None:
    """List the warm pools of a backend, or empty them (--drain)."""
    from rollout_worker import core
    from rollout_worker.backends import get_backend
    from rollout_worker.backends.base import PoolBackend
    from rollout_worker.store import Store

    settings = load_settings(redis_url)
    store = Store.from_url(settings.redis_url, settings.record_ttl)
    try:
        backend = get_backend(backend_name, settings)
        assert isinstance(backend, PoolBackend)
        if drain:
            for item in core.drain_pools(store, backend, idle_seconds=None, now=time.time()):
                out(f"{item.action:12} {item.batch_id}  {item.reason}", highlight=False)
        registry = store.registered_pools()
        for key, found in backend.list_pools().items():
            used = registry.get(key, {}).get("used_at")
            idle = f"{time.time() - used:.0f}s" if used else "unregistered"
            out(
                f"pool {key}  {found['namespace']}  waiting {found['waiting']}  running "
                f"episodes {found['claimed_running']}  pods {found['pods']}  idle {idle}",
                highlight=False,
            )
    except RolloutError as exc:
        raise click.ClickException(str(exc)) from exc


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

    from rollout_wire.redis_url import redis_client
    from rollout_worker.celery_app import create_app

    settings = load_settings(redis_url)
    problems = []
    try:
        redis_client(
            settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
        ).ping()
        out(f"redis: ok ({redacted(settings.redis_url)})")
    except redis_lib.RedisError as exc:
        raise click.ClickException(
            f"redis at {redacted(settings.redis_url)} is not reachable: {exc}"
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
        from rollout_worker.backends.kube.backend import KubernetesBackend
        from rollout_worker.backends.kube.permissions import cluster_check

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
    from rollout_worker.backends.kube.read import handle_from_receipt

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
    settings = load_settings(None)
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


@cli.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def host(args: tuple[str, ...]) -> None:
    """A sandbox host: take episodes of `isolation: host` batches and run each in a fresh
    bubblewrap sandbox (`rollout host --help` for its options)."""
    from rollout_worker.backends.host.agent import main as host_main

    sys.exit(host_main(list(args), prog="rollout host"))


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
    "--hangs",
    is_flag=True,
    help="Make the script's 'hang' turns hang (policy timeouts); without it they submit.",
)
@click.option(
    "--hang-seconds", type=float, default=30.0, show_default=True, help="A scripted 'hang'."
)
@click.option(
    "--turn-seconds",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Every turn waits this long before its answer.",
)
@click.option(
    "--slow-fraction",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="The fraction of samples (a stable hash of group and sample) whose turns are slow.",
)
@click.option(
    "--slow-factor",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="A slow sample's turns wait turn-seconds times this.",
)
@click.option(
    "--policy-version",
    type=int,
    default=0,
    show_default=True,
    help="The first policy version (X-Policy-Version; POST /version changes it).",
)
@click.option("--verbose", is_flag=True, help="Log every request.")
def policy_server(
    host: str,
    port: int,
    script: Path | None,
    hangs: bool,
    hang_seconds: float,
    turn_seconds: float,
    slow_fraction: float,
    slow_factor: float,
    policy_version: int,
    verbose: bool,
) -> None:
    """Serve the scripted policy (OpenAI-compatible chat completions, no GPU) for the bundled
    task set: right and wrong fixes, malformed and slow replies, timed-out ones with --hangs;
    a latency tail and a policy version for scheduling and staleness experiments."""
    from rollout_worker.cli.policy_server import PolicyServer, load_script

    server = PolicyServer(
        host,
        port,
        load_script(script),
        hang_seconds,
        verbose,
        hangs=hangs,
        turn_seconds=turn_seconds,
        slow_fraction=slow_fraction,
        slow_factor=slow_factor,
        version=policy_version,
    )
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
