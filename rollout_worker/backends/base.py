"""The backend protocol: how the pipeline starts, observes, reads and deletes a run.

A run is one batch's sandboxes (a Kubernetes Job, or a locally supervised process set). Its
`RunHandle` travels as JSON in the receipt, so any worker process can pick the run up again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar, runtime_checkable

from rollout_wire.errors import BackendError
from rollout_wire.request import BatchSpec
from rollout_wire.states import RunVerdict
from rollout_worker.observation import EpisodeObservation

# What a backend returns of one episode's log at most (`read_output`): past it the log is cut,
# and says so, so a flood never fills a reader, a Redis value or the disk.
MAX_LOG_BYTES = 8 * 2**20

# Merges fields into the batch receipt (stored before any mutation, updated as UIDs appear).
ReceiptUpdate = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class WarmClaim:
    """An episode taken from a warm pool: its index and the pool Pod (name, UID: the proof
    cleanup deletes by). Stored as the list [index, pod, uid], as receipts always held it."""

    index: int
    pod: str
    uid: str

    def to_list(self) -> list[Any]:
        return [self.index, self.pod, self.uid]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> WarmClaim:
        index, pod, uid = item
        return cls(index, str(pod), str(uid))


@dataclass(frozen=True)
class RunHandle:
    """What a backend needs to find, observe and delete a run it created, and the proof
    (UIDs) that it created it: the fields every backend has. Each backend's own are in its
    subclass (`KubeRunHandle`, `LocalRunHandle`), chosen by `backend` (`from_dict`)."""

    backend: str
    batch_id: str
    origin: float  # when the run was created: the guide's "Job created", time zero of metrics
    episode_prefix: str  # episode ids are f"{episode_prefix}-{index}" (Pods add a suffix)
    context: str  # kubeconfig context, or local:<host>
    # The batch's retry budget per episode (BatchSpec.infra_retries): how many earlier attempts
    # of an episode its collector accepts as retries instead of restarts.
    infra_retries: int = 0

    @property
    def fed(self) -> bool:
        """Fed from its pool by a task (`FeedingBackend.feed_run`): only a Kubernetes run can
        be (the local supervisor feeds its own run)."""
        return False

    def episode_id(self, index: int) -> str:
        return f"{self.episode_prefix}-{index}"

    def to_dict(self) -> dict[str, Any]:
        """The receipt's `run`: this handle's fields in declaration order (the shared ones
        first), so a handle written by today's code reads back the same."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunHandle:
        """The handle of the run's backend (its `backend` field); another backend's fields,
        as receipts stored before the split hold them (None where unused), are ignored."""
        kind = HANDLE_KINDS.get(str(data.get("backend")), RunHandle)
        return kind._read(data)

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> RunHandle:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class KubeRunHandle(RunHandle):
    """A Kubernetes run: its namespace and Jobs, and the warm pool Pods it took."""

    namespace: str | None = None
    namespace_uid: str | None = None
    job_name: str | None = None  # the first (usually only) Job
    job_uid: str | None = None
    jobs: dict[str, str] = field(default_factory=dict)  # every Job of the run: name -> UID
    # Episodes taken from a warm pool, in the pool's namespace.
    pool_namespace: str | None = None
    warm: tuple[WarmClaim, ...] = ()
    # Fed from its pool: no Job; the episodes not claimed at the start are claimed one per
    # freed slot by the feeder (`feed_run`), and appended to `warm` in the receipt.
    fed: bool = False

    def job_uids(self) -> dict[str, str | None]:
        """Every Job of the run by name (a run recorded before `jobs` existed has one)."""
        if self.jobs:
            return dict(self.jobs)
        return {self.job_name: self.job_uid} if self.job_name else {}

    def in_pool(self, index: int) -> bool:
        """Whether episode `index` runs (or will run) in a pool Pod, not a Job's."""
        return self.fed or self.warm_pod(index) is not None

    def warm_pod(self, index: int) -> tuple[str, str] | None:
        """(name, UID) of the warm Pod that runs episode `index`, if one does."""
        for claim in self.warm:
            if claim.index == index:
                return claim.pod, claim.uid
        return None

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"jobs": dict(self.jobs), "warm": self.warm_lists()}

    def warm_lists(self) -> list[list[Any]]:
        """`warm` as the receipt holds it."""
        return [claim.to_list() for claim in self.warm]

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> RunHandle:
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["warm"] = tuple(WarmClaim.from_list(c) for c in data.get("warm") or ())
        return cls(**values)


@dataclass(frozen=True)
class LocalRunHandle(RunHandle):
    """A local run: its folder (and the UID that proves it ours), on one node."""

    run_dir: str | None = None
    run_uid: str | None = None
    isolation: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class HostRunHandle(RunHandle):
    """A run on the sandbox hosts (`isolation: host`): its registration in Redis (the UID
    that proves it ours) and the episode program the hosts must run."""

    run_uid: str | None = None
    program_sha: str | None = None


H = TypeVar("H", bound=RunHandle)


def handle_as(kind: type[H], handle: RunHandle) -> H:
    """The handle as its backend wrote it (the protocol passes the common type)."""
    if not isinstance(handle, kind):
        raise BackendError(f"run of batch {handle.batch_id} is a {handle.backend} run")
    return handle


# The handle of each backend, by its name (the `backend` field); another (a test's stub)
# gets the shared fields alone.
HANDLE_KINDS: dict[str, type[RunHandle]] = {
    "kubernetes": KubeRunHandle,
    "local": LocalRunHandle,
    "hosts": HostRunHandle,
}


@dataclass(frozen=True)
class FinishedRun:
    """A run once every episode is collected: its records and how it ended."""

    records: dict[str, str] = field(default_factory=dict)  # file name -> text (job.json, ...)
    completed_at: float | None = None  # the Job's Complete/Failed time, or the last exit
    verdict: RunVerdict = RunVerdict.UNKNOWN
    facts: dict[str, Any] = field(default_factory=dict)  # backend-specific, shown as run_<name>


class Backend(Protocol):
    name: str
    # Its sandboxes stream their own progress (running, ready); otherwise a collector streams
    # what it sees, so it parks only once its episode is ready (core/park.py).
    streams_progress: bool

    def preflight(self, spec: BatchSpec) -> list[str]:
        """Check the run can start; raise BackendError if not, return warnings otherwise."""

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> RunHandle:
        """Create the run, or find and verify the one already created for this batch id."""

    def wait_episode(
        self, handle: RunHandle, index: int, timeout: float, *, until_ready: bool = False
    ) -> EpisodeObservation:
        """Observe episode `index`, waiting up to `timeout` seconds for it to be terminal (or,
        with `until_ready`, for `obs.ready` too: progress, where the backend does not stream
        it itself)."""

    def wait_ended(
        self, handle: RunHandle, indexes: list[int], timeout: float, *, ready: AbstractSet[int]
    ) -> list[int]:
        """Those of `indexes` whose episodes have ended (or, for those in `ready`, are ready),
        waiting up to `timeout` seconds for one. For the batch's waker (one per process),
        called again and again: cheap per call, whatever their number and however long they
        run. It may miss an end that its collector would find by
        asking more (a Pod never created): the watchdog's rescue and the deadline cover those."""

    def resume_run(self, handle: RunHandle) -> None:
        """Make sure what runs the episodes still runs (the lifecycle calls this when an
        episode has not ended after a wait): a controller that died mid-run is started again
        and reports the episodes it lost as failed."""

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        """The episode's log (its stdout)."""

    def run_status(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        """How the run stands now, at once (no records, no waiting): for the report."""

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        """Once every episode is collected: the run's records and how it ended (may wait a
        bounded time for the backend to settle)."""

    def cancel_run(self, handle: RunHandle) -> None:
        """Stop the run's sandboxes now (its records stay until `delete_run`)."""

    def list_runs(self) -> list[str]:
        """Batch ids of the runs of ours this backend can see (for the sweeper's report)."""

    def delete_run(self, handle: RunHandle) -> bool:
        """Delete everything the run created, after proving it is ours. Never waits for a slow
        deletion: True once the run is gone, False while it is still being deleted."""


@runtime_checkable
class PoolBackend(Protocol):
    """A backend with warm pools (both: Kubernetes keeps pool Pods in a namespace per pool,
    the local backend a pool process per pool, with bwrap only): sandboxes started ahead of
    demand that a batch takes before it starts cold ones (in `start_run` on Kubernetes, in its
    supervisor locally)."""

    name: str

    def pool_key(self, spec: BatchSpec) -> str | None:
        """The pool a batch of this shape takes from (None: its shape cannot have one)."""

    def fill_pool(
        self, spec: BatchSpec, size: int, budget: int, idle_seconds: float, record: ReceiptUpdate
    ) -> dict[str, int]:
        """Make the pool of the spec's shape hold `size` waiting sandboxes, within `budget`
        waiting over all pools; `record` names what is created before it is."""

    def drain_pool(self, key: str, namespace_uid: str | None) -> bool:
        """Delete the pool's waiting sandboxes, then (once no episode runs in it) the pool,
        after proving it is ours (`namespace_uid`: the UID the pool registry holds, its
        namespace's on Kubernetes, its own locally). True once it is gone."""

    def list_pools(self) -> dict[str, dict[str, Any]]:
        """The pools of ours this backend can see, by key: {namespace (locally its folder),
        uid, waiting, claimed_running, pods}."""


@dataclass(frozen=True)
class Fed:
    """One look of the feeder: the claims made so far (those of earlier looks included) and
    whether it is done (every episode claimed, or the run cannot take more)."""

    claims: list[WarmClaim]
    done: bool


@runtime_checkable
class FeedingBackend(Protocol):
    """A backend whose runs may be fed from a pool by a task (Kubernetes; the local
    supervisor feeds its own run)."""

    name: str

    def feed_run(
        self,
        spec: BatchSpec,
        handle: RunHandle,
        record: ReceiptUpdate,
        *,
        timeout: float,
        budget: int,
        idle_seconds: float,
    ) -> Fed:
        """For up to `timeout` seconds: claim a waiting pool sandbox for the next episode
        whenever one of the run's slots is free (the claims so far are the handle's `warm`),
        and keep the pool topped up ahead of the batch (within `budget` waiting sandboxes over
        all pools). `record` gets each Pod a claim may touch before its claim."""
