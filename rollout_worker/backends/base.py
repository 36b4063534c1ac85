"""The backend protocol: how the pipeline starts, observes, reads and deletes a run.

A run is one batch's sandboxes (a Kubernetes Job, or a locally supervised process set). The
handle a backend returns is plain JSON: it travels in the receipt and in task arguments, so
any worker process can pick the run up again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rollout_worker.models import BatchSpec, EpisodeObservation

RunHandle = dict[str, Any]
# Merges fields into the batch receipt (stored before any mutation, updated as UIDs appear).
ReceiptUpdate = Callable[[dict[str, Any]], None]


class Backend(Protocol):
    name: str

    def preflight(self, spec: BatchSpec) -> list[str]:
        """Check the run can start; raise BackendError if not, return warnings otherwise."""

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> RunHandle:
        """Create the run, or find and verify the one already created for this batch id."""

    def episode_id(self, handle: RunHandle, index: int) -> str:
        """The sandbox name of episode `index` (known before the sandbox exists)."""

    def wait_episode(self, handle: RunHandle, index: int, timeout: float) -> EpisodeObservation:
        """Observe episode `index`, waiting up to `timeout` seconds for it to be terminal."""

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        """The episode's log (its stdout)."""

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> dict[str, Any]:
        """Once every episode is collected: records (name -> text) and facts about the run.

        Returns {"records": {...}, "facts": {"completed_at": unix time or None, ...}}.
        """

    def delete_run(self, handle: RunHandle) -> None:
        """Delete everything the run created, after proving it is ours."""
