"""The Celery application factory. Settings go in once; everything reliability-related is here."""

from __future__ import annotations

from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS, Channel

from rollout_wire import constants as k
from rollout_wire.redis_url import celery_settings
from rollout_worker.settings import Settings

# Tasks that wait on episodes run beside the collectors (scaled with them), the rest on control.
COLLECT_TASKS = (k.TASK_COLLECT, k.TASK_FEED, k.TASK_WAKE)
# The Redis lists behind the collect queue: kombu keeps one per priority step and reads them
# in this order (a batch's first collect messages wait in the last, woken ones in the first).
# What counts the queue's backlog (KEDA, tests) reads them all.
COLLECT_LISTS = tuple(
    k.QUEUE_COLLECT if step == 0 else f"{k.QUEUE_COLLECT}{Channel.sep}{step}"
    for step in PRIORITY_STEPS
)


def celery_config(settings: Settings) -> dict[str, object]:
    # The broker and result backend from ROLLOUT_REDIS_URL: as it is, or for a Sentinel URL
    # kombu's `sentinel://` form with master_name (and TLS options) in the transport options.
    redis_conf = celery_settings(settings.redis_url)
    return {
        **redis_conf,  # broker_url, result_backend (and broker_use_ssl... for sentinel+rediss)
        # JSON only: nothing a worker receives can execute code when decoded.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # A task is acknowledged after it ran; a worker killed mid-task gives it back.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": {
            **redis_conf["broker_transport_options"],
            "visibility_timeout": settings.visibility_timeout,
            # Sweep for a dead worker's unacked messages every 10 s instead of every ~100 s.
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 1,
            # An idle consumer's BRPOP returns every 5 s instead of every 1 s (a message still
            # wakes it at once): an idle worker's CPU fell by about 40%, which a long batch
            # pays over its whole wall.
            "polling_interval": 5,
        },
        "result_backend_transport_options": {
            **redis_conf["result_backend_transport_options"],
            "visibility_timeout": settings.visibility_timeout,
        },
        "result_expires": settings.result_expires,
        "broker_connection_retry_on_startup": True,
        # Tasks keep running through a broker reconnect (a Redis restart): they are idempotent,
        # and cancelling them crashes a threads-pool worker ("does not implement kill_job").
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_default_queue": k.QUEUE_CONTROL,
        # Every task on `control` except the per-episode collectors (scaled apart).
        "task_routes": {
            name: {"queue": k.QUEUE_COLLECT if name in COLLECT_TASKS else k.QUEUE_CONTROL}
            for name in k.TASKS
        },
        "worker_hijack_root_logger": False,
        # Run by `rollout worker --beat` (one per deployment); every run is idempotent.
        "beat_schedule": {
            "sweep": {"task": k.TASK_SWEEP, "schedule": settings.sweep_seconds},
        },
        "task_send_sent_event": True,
    }


def create_app(settings: Settings, *, with_tasks: bool = True) -> Celery:
    """A configured app. `with_tasks=False` gives a client that only sends tasks by name."""
    app = Celery("rollout", set_as_current=False)
    app.conf.update(celery_config(settings))
    app.rollout_settings = settings
    if with_tasks:
        from rollout_worker.tasks import register

        register(app)
    return app


def __getattr__(name: str) -> object:
    """`celery -A rollout_worker.celery_app:app ...` (the workers' health checks, Flower): an
    app without tasks configured from the environment like the workers, so the `celery`
    command reaches the broker whatever form ROLLOUT_REDIS_URL takes (a Sentinel URL needs
    master_name in the transport options, which `celery --broker URL` cannot say)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global _cli_app
    if _cli_app is None:
        _cli_app = create_app(Settings.from_env(), with_tasks=False)
    return _cli_app


_cli_app: Celery | None = None
