"""One batch for many concurrent asks of one episode each: what a trainer that runs one agent
loop per sample (verl) needs, so a step of 512 prompts x 16 samples is one submission, not
8,192.

Asks arriving within `window` seconds of the first are sent together: one batch per distinct
number of asks per task (GRPO asks every task the same number of times: one batch), each task
once with that many samples. Each ask is answered as its task's group completes, not when the
whole batch does, so a slow group holds back only its own loops.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer_stub.adapters.samples import (
    TrainingSample,
    last_turn,
    samples_of_row,
    submit_episodes,
)
from trainer_stub.client import RolloutClient

# Long enough for a step's loops (started together) to land in one batch, short beside an
# episode's seconds.
DEFAULT_WINDOW_SECONDS = 0.05


@dataclass(frozen=True)
class _Ask:
    task_id: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[TrainingSample]


def _settle(future: asyncio.Future[TrainingSample], outcome: TrainingSample | Exception) -> None:
    if future.done():  # its loop gave up on it (cancelled)
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class EpisodeBatcher:
    """Gathers concurrent `episode(task_id)` asks into batches of `request` (its tasks, its
    policy and limits) served by `client`. Safe to share between event loops and threads."""

    def __init__(
        self,
        client: RolloutClient,
        request: Mapping[str, Any],
        timeout: float = 900.0,
        window: float = DEFAULT_WINDOW_SECONDS,
    ) -> None:
        self.client, self.request, self.timeout, self.window = client, request, timeout, window
        self.tasks = {str(t["id"]) for t in request["tasks"]}
        self._lock = threading.Lock()
        self._pending: list[_Ask] = []

    async def episode(self, task_id: str) -> TrainingSample:
        """One episode of `task_id` (in a batch with the asks around it): its training sample
        (the last turn of a stepwise episode)."""
        if task_id not in self.tasks:
            raise ValueError(f"task {task_id!r} is not in this request")
        loop = asyncio.get_running_loop()
        ask = _Ask(task_id, loop, loop.create_future())
        with self._lock:
            self._pending.append(ask)
            first = len(self._pending) == 1
        if first:
            loop.call_later(self.window, self._flush)
        return await ask.future

    def _flush(self) -> None:
        with self._lock:
            asks, self._pending = self._pending, []
        by_task: dict[str, list[_Ask]] = defaultdict(list)
        for ask in asks:
            by_task[ask.task_id].append(ask)
        by_count: dict[int, dict[str, list[_Ask]]] = defaultdict(dict)
        for task_id, its_asks in by_task.items():
            by_count[len(its_asks)][task_id] = its_asks
        for count, batch in by_count.items():
            threading.Thread(target=self._run, args=(batch, count), daemon=True).start()

    def _run(self, asks: dict[str, list[_Ask]], samples: int) -> None:
        """One batch: each task once x `samples`; each ask answered as its group completes."""
        answered: set[int] = set()
        try:
            submission = submit_episodes(self.client, self.request, list(asks), samples)
            for _, rows in self.client.sampled_groups(submission.batch_id, self.timeout):
                for row in rows:
                    found = samples_of_row(row)
                    waiting = asks.get(found[0].task_id, [])
                    if 0 <= found[0].sample < len(waiting):
                        self._answer(waiting[found[0].sample], last_turn(found))
                        answered.add(id(waiting[found[0].sample]))
            missing: Exception = RuntimeError(
                f"batch {submission.batch_id} ended without this episode's row"
            )
        except Exception as exc:  # the submission or the wait failed: every ask says so
            missing = exc
        for its_asks in asks.values():
            for ask in its_asks:
                if id(ask) not in answered:
                    self._answer(ask, missing)

    @staticmethod
    def _answer(ask: _Ask, outcome: TrainingSample | Exception) -> None:
        ask.loop.call_soon_threadsafe(_settle, ask.future, outcome)
