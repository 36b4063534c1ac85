"""A Celery app with our production configuration and one no-op task, for the baseline."""

from rollout_worker.celery_app import create_app
from rollout_worker.settings import Settings

app = create_app(Settings.from_env(), with_tasks=False)


@app.task(name="bench.noop", acks_late=True)
def noop(index: int) -> int:
    return index


@app.task(name="bench.done", acks_late=True)
def done(results: list[int]) -> int:
    return len(results)
