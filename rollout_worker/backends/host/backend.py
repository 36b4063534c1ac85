"""The sandbox hosts' backend (`backend: kubernetes`, `isolation: host`): the Celery side.

It talks to Redis only, never to the Kubernetes API: a run is a registration and a document
in the host queue (queue.py), which the host Pods' agents take episode by episode and run with
the local supervisor's machinery in fresh bubblewrap sandboxes. Their ends come back as
statuses in Redis, with the same done signal the local supervisor sends, so collectors wait
and read here as they do on the local backend.
"""

from __future__ import annotations

import ipaddress
import time
import uuid
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

import orjson

from rollout_wire.errors import BackendError, BackendUnavailable, OwnershipError
from rollout_wire.policy import PolicyEndpoint
from rollout_wire.redis_url import redis_client
from rollout_wire.request import BatchSpec
from rollout_wire.states import RunVerdict
from rollout_worker.backends.base import (
    FinishedRun,
    HostRunHandle,
    ReceiptUpdate,
    RunHandle,
    handle_as,
)
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.backends.host.warm import cold_reason
from rollout_worker.backends.local.files import OWNER
from rollout_worker.backends.local.run_file import program_sha
from rollout_worker.backends.local.sandbox import rootfs_dirname
from rollout_worker.backends.local.signal import DoneSignal
from rollout_worker.observation import EpisodeObservation
from rollout_worker.quantities import parse_quantity, sandbox_limits, storage_bytes
from rollout_worker.settings import Settings

# As the local backend: how long a cancel waits for the hosts to stop the batch's sandboxes.
CANCEL_WAIT_SECONDS = 30.0
CANCEL_POLL_SECONDS = 0.2
CONTEXT = "hosts"


def run_document(spec: BatchSpec, run_uid: str, *, created_at: float, ttl: int) -> dict[str, Any]:
    """What a host needs of the run: the local run.json less the fields of the machine that
    runs the sandboxes (interpreter, image id, rootfs, node, Redis), which each host adds."""
    memory_bytes, cpu_seconds = sandbox_limits(spec.resources, spec.episode_timeout_seconds)
    return {
        "owner": OWNER,
        "batch_id": spec.batch_id,
        "run_uid": run_uid,
        "created_at": created_at,
        "spec": spec.to_dict(),
        "limits": {
            "memory_bytes": memory_bytes,
            "cpu_seconds": cpu_seconds,
            "storage_bytes": storage_bytes(spec.resources),
        },
        "episode_prefix": f"rollout-{spec.batch_id}",
        "isolation": "bwrap",
        "program_sha": program_sha(),
        "progress": {"batch_id": spec.batch_id, "ttl": ttl},
    }


def slot_problems(spec: BatchSpec, hosts: dict[str, dict[str, Any]]) -> list[str]:
    """Limits of the batch larger than every host's slot (where the heartbeats say a slot's
    size, from the agents' --slot-memory and --slot-storage): no host could run one of its
    episodes."""
    wanted = {
        # The memory limit itself: a slot is sized as an episode Pod's limit, and the sandbox's
        # address-space headroom over it is no memory the host reserves.
        "slot_memory_bytes": int(parse_quantity(spec.resources.memory_limit)),
        "slot_storage_bytes": storage_bytes(spec.resources),
    }
    problems = []
    for field, need in wanted.items():
        sizes = [int(h[field]) for h in hosts.values() if isinstance(h.get(field), int)]
        if need and sizes and need > max(sizes):
            what = field.removeprefix("slot_").replace("_", " ")
            problems.append(f"the batch's {what} {need} is over a host slot's ({max(sizes)})")
    return problems


def _allows(policy: PolicyEndpoint, egress: list[dict[str, Any]]) -> bool:
    if not policy.is_ip:
        return False  # a NetworkPolicy matches addresses only
    address = ipaddress.ip_address(policy.host)
    for rule in egress:
        try:
            network = ipaddress.ip_network(str(rule.get("cidr")), strict=False)
        except ValueError:
            continue
        if rule.get("port") == policy.port and address in network:
            return True
    return False


def egress_problems(spec: BatchSpec, hosts: dict[str, dict[str, Any]]) -> list[str]:
    """The batch's policy endpoint outside a live host's policy egress (its NetworkPolicy's
    list, which the agent tells in its heartbeat from --policy-egress): any host takes any
    episode, so every host must reach it. A host that tells no list claims no limit."""
    policy = spec.policy
    if policy is None:
        return []
    closed = sorted(
        name
        for name, info in hosts.items()
        if isinstance(info.get("policy_egress"), list)
        and not _allows(policy, info["policy_egress"])
    )
    if not closed:
        return []
    allowed = sorted(
        {f"{r.get('cidr')}:{r.get('port')}" for n in closed for r in hosts[n]["policy_egress"]}
    )
    return [
        f"the batch's policy endpoint {policy.host}:{policy.port} is outside the policy egress "
        f"of sandbox hosts {closed} (they may reach {allowed or 'no policy endpoint'}: the "
        "chart's hosts.policyEgress)"
    ]


def image_problems(spec: BatchSpec, hosts: dict[str, dict[str, Any]]) -> list[str]:
    """Task images some live host does not carry (its heartbeat's `images`: the folders of
    its --rootfs that hold an image's root, sandbox.rootfs_dirname). Any host takes any
    episode from the one list, so every live host must carry every image of the batch."""
    images = sorted({str(t["image"]) for t in spec.tasks if t.get("image") and not t.get("files")})
    problems = []
    for image in images:
        folder = rootfs_dirname(image)
        lacking = sorted(n for n, h in hosts.items() if folder not in (h.get("images") or []))
        if not lacking:
            continue
        carried = {n: sorted(hosts[n].get("images") or []) for n in lacking}
        who = (
            "no live sandbox host carries it"
            if len(lacking) == len(hosts)
            else f"sandbox hosts {lacking} do not carry it"
        )
        problems.append(
            f"task image {image} (folder {folder}): {who} (their images: {carried}); any "
            "live host may take any episode, so every one must: add it to the pool's images "
            "(the chart's hosts.images) or run the batch with isolation: pod"
        )
    return problems


class HostBackend:
    name = "hosts"
    streams_progress = True  # the hosts' supervisors stream running/ready, as locally

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.queue = HostQueue(redis_client(settings.redis_url, health_check_interval=30))
        self._signal: DoneSignal | None = None

    def _done_signal(self) -> DoneSignal:
        if self._signal is None:
            self._signal = DoneSignal.from_url(self.settings.redis_url)
        return self._signal

    # -- protocol ----------------------------------------------------------------------------
    def preflight(self, spec: BatchSpec) -> list[str]:
        """Refuse, before anything is created, what no live host can run."""
        # A draining host (SIGTERM, scale-down) takes nothing more.
        hosts = {
            name: info for name, info in self.queue.hosts().items() if not info.get("draining")
        }
        if not hosts:
            raise BackendUnavailable(
                "no live sandbox host (isolation: host): none that is not draining has sent a "
                "heartbeat in the last 15 s; start the hosts (the chart's hosts.enabled) or use "
                "isolation: pod"
            )
        sha = program_sha()
        ours = {name: info for name, info in hosts.items() if info.get("program_sha") == sha}
        if not ours:
            theirs = sorted({str(info.get("program_sha"))[:12] for info in hosts.values()})
            raise BackendUnavailable(
                f"no sandbox host runs this worker's episode program {sha[:12]} (the hosts run "
                f"{theirs}): upgrade the hosts and the workers together"
            )
        problems = [
            *_task_problems(spec),
            *slot_problems(spec, ours),
            *egress_problems(spec, ours),
            *image_problems(spec, ours),
        ]
        if problems:
            raise BackendUnavailable("; ".join(problems))
        cold = cold_reason(spec, "bwrap") if spec.warm_pool else None
        if cold is not None:
            # Hosts keep waiting sandboxes per batch (host/warm.py); not for these tasks.
            return [f"warm_pool: the hosts start this batch's episodes cold ({cold})"]
        return []

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> HostRunHandle:
        batch = spec.batch_id
        known = self.queue.run_info(batch)
        run_uid = known.get("run_uid") or uuid.uuid4().hex
        created_at = float(known.get("created_at") or time.time())
        handle = HostRunHandle(
            backend=self.name,
            batch_id=batch,
            origin=created_at,
            episode_prefix=f"rollout-{batch}",
            context=CONTEXT,
            infra_retries=spec.infra_retries,
            run_uid=run_uid,
            program_sha=program_sha(),
        )
        record({"run": handle.to_dict()})  # before the run exists: the proof cleanup needs
        doc = run_document(spec, run_uid, created_at=created_at, ttl=self.settings.record_ttl)
        deadline_at = created_at + spec.deadline_seconds
        self.queue.enqueue(
            batch,
            run_uid,
            orjson.dumps(doc),
            spec.count,
            spec.parallelism,
            deadline_at,
            spec.infra_retries,
        )
        # A redelivered start that raced the first one: the first registration stands.
        registered = self.queue.run_info(batch)
        if registered.get("run_uid") != run_uid:
            uid, origin = registered.get("run_uid"), registered.get("created_at")
            handle = replace(handle, run_uid=uid, origin=float(origin or created_at))
            record({"run": handle.to_dict()})
        return handle

    def wait_episode(
        self, handle: RunHandle, index: int, timeout: float, *, until_ready: bool = False
    ) -> EpisodeObservation:
        # `until_ready` is moot: the hosts stream ready/rewarded from the output.
        batch = handle.batch_id
        end = time.monotonic() + timeout
        while True:
            status = self.queue.status(batch, index)
            if status is not None:
                return EpisodeObservation.from_dict(status)
            info = self.queue.run_info(batch)
            if not info:
                # Deleted (after its report, or cancelled): a late copy of a collect task.
                raise BackendError(f"host run of batch {batch} is gone")
            if time.time() >= float(info["deadline_at"]):
                self.queue.reap(batch)  # past its deadline: what no host holds ends now
                status = self.queue.status(batch, index)
                if status is not None:
                    return EpisodeObservation.from_dict(status)
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            self._done_signal().wait(batch, index, remaining)
        host = self.queue.taken(batch).get(index)
        return EpisodeObservation(
            index=index,
            episode_id=handle.episode_id(index),
            phase="Pending" if host is None else "Running",
            node=host,
        )

    def wait_ended(
        self, handle: RunHandle, indexes: list[int], timeout: float, *, ready: AbstractSet[int]
    ) -> list[int]:
        # `ready` is moot: the hosts stream it, so no collector parks until ready.
        batch = handle.batch_id
        end = time.monotonic() + timeout
        while True:
            ended = self.queue.ended(batch, indexes)
            if ended is None:
                return list(indexes)  # deleted: its collectors record that it is gone
            if ended or not indexes:
                return ended
            remaining = end - time.monotonic()
            if remaining <= 0:
                return []
            self._done_signal().wait_any(batch, indexes, remaining)

    def resume_run(self, handle: RunHandle) -> None:
        """A host that died mid-episode: its episodes go back to the list (or end HostLost
        once the retry budget is spent); past the deadline, what no host holds ends."""
        self.queue.reap(handle.batch_id)

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        log = self.queue.log(handle.batch_id, obs.index)
        return "" if log is None else log.decode("utf-8", errors="replace")

    def run_status(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        return self._finished(spec, handle, records=False)

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        return self._finished(spec, handle, records=True)

    def _finished(self, spec: BatchSpec, handle: RunHandle, *, records: bool) -> FinishedRun:
        batch = handle.batch_id
        statuses = self.queue.statuses(batch)
        ran: dict[str, int] = {}
        for status in statuses.values():
            if status.get("node"):
                ran[str(status["node"])] = ran.get(str(status["node"]), 0) + 1
        verdict, completed_at = RunVerdict.RUNNING, None
        if len(statuses) >= spec.count:
            # Like the Job controller: Complete when every episode's sandbox succeeded.
            ok = all(s.get("phase") == "Succeeded" for s in statuses.values())
            verdict = RunVerdict.COMPLETE if ok else RunVerdict.FAILED
            completed_at = max(
                (float(s.get("finished_at") or 0) for s in statuses.values()), default=None
            )
        files: dict[str, str] = {}
        if records:
            files = {
                name: data.decode("utf-8", "replace")
                for name, data in self.queue.records(batch).items()
            }
            attempts = self.queue.all_attempts(batch)
            placed = {
                str(i): {"host": s.get("node"), "attempts": attempts.get(i, [])}
                for i, s in sorted(statuses.items())
            }
            files["hosts.json"] = orjson.dumps(placed, option=orjson.OPT_INDENT_2).decode()
        return FinishedRun(
            records=files,
            completed_at=completed_at,
            verdict=verdict,
            facts={"isolation": "host", "hosts": dict(sorted(ran.items()))},
        )

    def cancel_run(self, handle: RunHandle) -> None:
        """Nothing more of the batch is taken; wait (up to CANCEL_WAIT_SECONDS) until no host
        runs any of it: each kills its sandboxes of a stopped batch and sends their ends."""
        batch = handle.batch_id
        self.queue.stop(batch)
        end = time.monotonic() + CANCEL_WAIT_SECONDS
        while self.queue.taken(batch):
            self.queue.reap(batch)  # a host gone meanwhile holds nothing for long
            if time.monotonic() > end:
                raise BackendError(
                    f"sandbox hosts still run episodes of batch {batch} "
                    f"{CANCEL_WAIT_SECONDS:.0f}s after its cancel"
                )
            time.sleep(CANCEL_POLL_SECONDS)

    def list_runs(self) -> list[str]:
        return sorted(self.queue.runs())

    def delete_run(self, handle: RunHandle) -> bool:
        run_uid = handle_as(HostRunHandle, handle).run_uid
        if not run_uid:
            raise OwnershipError(f"host run of batch {handle.batch_id} records no run_uid")
        if not self.queue.delete(handle.batch_id, run_uid):
            found = self.queue.run_info(handle.batch_id).get("run_uid")
            raise OwnershipError(
                f"refusing to delete the host run of batch {handle.batch_id}: its run_uid "
                f"{found} is not the receipt's {run_uid}"
            )
        return True


def _task_problems(spec: BatchSpec) -> list[str]:
    """What a shared sandbox host cannot be given: per-batch secrets and folders of the
    worker's machine (task images: image_problems, from the hosts' heartbeats)."""
    problems = []
    for task in spec.tasks:
        if task.get("env"):
            problems.append(
                f"task {task.get('id')!r} has env tables: their values (secrets) cannot reach a "
                "shared sandbox host"
            )
    if spec.task_env_secret is not None:
        problems.append(
            f"task_env_secret {spec.task_env_secret!r}: a shared sandbox host reads no Secret"
        )
    if spec.agent_env is not None:
        problems.append(
            f"agent_env {spec.agent_env}: a folder of the worker's machine, which no sandbox "
            "host has"
        )
    return problems
