"""Warm pools on Kubernetes: the API calls (the objects are built in `objects.py`, the shape key
and hand-over line in `backends/warm.py`).

- `fill`: a pool's namespace (program ConfigMap, NetworkPolicy), then Pods up to a size within
  a budget of waiting Pods over all pools.
- `claim`: take waiting Pods for a batch's first episodes, each by a patch the server refuses if
  another batch got there first; the receipt names each Pod (and its UID) before its patch.
- hand-over (in `claim`, right after each Pod's own claim): send the episode straight to the
  Pod's port (`handover.py`, with ROLLOUT_WARM_HANDOVER_FROM), else write it to its stdin
  (attach), confirmed by its first event on stdout; a Pod the line cannot reach is deleted (its
  episode fails, it is not lost).
- `drain`: delete a pool's waiting Pods and, once no claimed Pod is left in it, its namespace.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.stream import stream

from rollout_wire import constants as k
from rollout_wire.errors import (
    BackendError,
    OwnershipError,
    ResourceConflict,
    ResourceNotFound,
    TransientBackendError,
)
from rollout_wire.request import BatchSpec
from rollout_wire.states import EVENT_KEY_MARK
from rollout_worker.backends import warm
from rollout_worker.backends.base import ReceiptUpdate, WarmClaim
from rollout_worker.backends.kube import handover, objects, read
from rollout_worker.backends.kube.namespaces import delete_namespace
from rollout_worker.backends.kube.pod_spec import CONTAINER_NAME

log = logging.getLogger(__name__)

# How long a hand-over waits for the episode's first event on the attached stdout.
CONFIRM_SECONDS = 10.0

Call = Callable[..., Any]


@dataclass(frozen=True)
class Claimed:
    index: int
    name: str
    uid: str
    claimed_at: float
    # Where its runner also listens (a Pod made for the direct hand-over), else None.
    direct: handover.Direct | None = field(default=None, compare=False, repr=False)

    @property
    def claim(self) -> WarmClaim:
        """What the run's handle keeps of it."""
        return WarmClaim(self.index, self.name, self.uid)


class WarmPools:
    def __init__(
        self,
        call: Call,
        text: Call,
        core: client.CoreV1Api,
        net: client.NetworkingV1Api,
        threads: int,
        handover_from: str | None = None,
    ) -> None:
        # Claims, hand-overs and Pod creations of one call run on at most this many threads:
        # each is a round trip (to the API server; a hand-over an attach or a connection to the
        # Pod), so the threads overlap waits, not CPU (ROLLOUT_WARM_HANDOVER_THREADS).
        self.threads = threads
        # ROLLOUT_WARM_HANDOVER_FROM: the CIDR a waiting Pod's hand-over port is open to; set,
        # new Pods listen there and claimed ones that do are handed over directly.
        self.handover_from = handover_from
        self._call = call
        self._text = text
        self.core = core
        self.net = net

    # -- a pool's objects --------------------------------------------------------------------
    def ensure(self, spec: BatchSpec, key: str, program: str, record: ReceiptUpdate) -> str:
        """The pool's namespace (created, or adopted when its labels say it is this pool),
        with its program and network policy. Returns the namespace's UID."""
        namespace = objects.pool_namespace(key)
        record({"namespace": namespace})
        try:
            ns = self._call(
                "create pool namespace",
                self.core.create_namespace,
                objects.pool_namespace_manifest(key),
            )
        except ResourceConflict:
            ns = self._call("read pool namespace", self.core.read_namespace, namespace)
            self._check_ours(ns, key)
            if ns["metadata"].get("deletionTimestamp"):
                # Drained a moment ago: the fill is retried once the namespace is gone.
                raise TransientBackendError(
                    f"pool namespace {namespace} is being deleted"
                ) from None
        record({"uid": ns["metadata"]["uid"]})
        for what, create, manifest in (
            ("configmap", self.core.create_namespaced_config_map, objects.pool_configmap_manifest),
            ("networkpolicy", self.net.create_namespaced_network_policy, None),
        ):
            body = manifest(key, program) if manifest else objects.pool_network_policy(spec, key)
            with contextlib.suppress(ResourceConflict):  # made by an earlier fill (ours: ns)
                self._call(f"create pool {what}", create, namespace, body)
        return str(ns["metadata"]["uid"])

    def _threads(self, fn: Callable[[Any], Any], items: Any) -> Iterator[Any]:
        return _threads(fn, items, self.threads)

    def _check_ours(self, obj: dict[str, Any], key: str) -> None:
        labels = obj["metadata"].get("labels") or {}
        if labels.get(k.LABEL_OWNER) != k.LABEL_OWNER_VALUE or labels.get(k.LABEL_POOL) != key:
            raise OwnershipError(
                f"{obj['metadata']['name']} exists but is not pool {key} (labels {labels}); "
                "refusing to use it"
            )

    def pods(self, key: str, selector: str = "") -> list[dict[str, Any]]:
        labels = objects.pool_selector(key)
        try:
            found = self._call(
                "list pool pods",
                self.core.list_namespaced_pod,
                objects.pool_namespace(key),
                label_selector=f"{labels},{selector}" if selector else labels,
            )
        except ResourceNotFound:
            return []
        return list(found.get("items", []))

    def idle_total(self) -> int:
        """Pool Pods of every pool that wait (or are starting) for a batch: the budget's count."""
        found = self._call(
            "list pool pods",
            self.core.list_pod_for_all_namespaces,
            label_selector=f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE},"
            f"{k.LABEL_POOL_STATE}={objects.POOL_STATE_IDLE}",
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
        )
        return len(found.get("items", []))

    def fill(
        self, spec: BatchSpec, key: str, size: int, budget: int, idle_seconds: float
    ) -> dict[str, int]:
        """Create Pods until the pool has `size` idle ones, without more than `budget` idle Pods
        in all pools together. Pods that ended while idle (their lifetime ran out) are deleted."""
        idle = self.pods(key, f"{k.LABEL_POOL_STATE}={objects.POOL_STATE_IDLE}")
        ended = [p for p in idle if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")]
        for pod in ended:
            self._delete_pod(pod)
        have = len(idle) - len(ended)
        room = max(0, budget - self.idle_total())
        wanted = max(0, min(size - have, room))
        namespace = objects.pool_namespace(key)
        if wanted and self.handover_from:
            # Before the Pods: a policy applies from a Pod's start on some CNIs. Here, not in
            # ensure: a feeder fills a pool an attach-only worker may have made.
            with contextlib.suppress(ResourceConflict):
                self._call(
                    "create pool networkpolicy",
                    self.net.create_namespaced_network_policy,
                    namespace,
                    objects.pool_handover_policy(key, self.handover_from),
                )

        def create(_: int) -> Any:
            # A token per Pod: knowing one Pod's spec hands over to no other.
            token = secrets.token_hex(16) if self.handover_from else None
            manifest = objects.pool_pod_manifest(spec, key, idle_seconds, handover_token=token)
            return self._call(
                "create pool pod", self.core.create_namespaced_pod, namespace, manifest
            )

        created = list(self._threads(create, range(wanted)))
        return {"waiting": have, "created": len(created), "budget_left": room - len(created)}

    # -- a batch takes Pods ------------------------------------------------------------------
    def claim(
        self, spec: BatchSpec, key: str, record: ReceiptUpdate, now: Callable[[], float]
    ) -> list[Claimed]:
        """Claim up to `spec.parallelism` waiting Pods for episodes 0, 1, ... and hand each its
        episode right after its own claim (one thread per Pod: no episode waits for another's
        claim). A redelivered start finds the Pods an earlier delivery claimed (by the batch
        label), claims no more and hands them over again (a runner reads one line only)."""
        namespace = objects.pool_namespace(key)
        pods = self.pods(key)
        mine = [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(k.LABEL_BATCH) == spec.batch_id
        ]
        if mine:
            claimed = sorted((_claimed(p) for p in mine), key=lambda c: c.index)
            again = [c for c in claimed if not self._handed_over(namespace, c)]
            list(self._threads(lambda c: self._hand_over(spec, namespace, c), again))
            return claimed
        # At most `parallelism`: a batch never starts more episodes at once than it asked for
        # (its Job's parallelism runs beside them only when it has more episodes than that).
        waiting = sorted(
            (p for p in pods if read.pool_pod_waiting(p)),
            key=lambda p: p["metadata"]["creationTimestamp"],
        )[: min(spec.count, spec.parallelism)]
        if not waiting:
            return []
        # The receipt names every Pod a patch may touch before the first patch.
        planned = [
            [index, p["metadata"]["name"], p["metadata"]["uid"]] for index, p in enumerate(waiting)
        ]
        record({"pool_namespace": namespace, "warm_planned": planned})
        return self.take(spec, namespace, list(enumerate(waiting)), now)

    def take(
        self,
        spec: BatchSpec,
        namespace: str,
        pairs: list[tuple[int, dict[str, Any]]],
        now: Callable[[], float],
    ) -> list[Claimed]:
        """Claim each Pod for its episode and hand it over right after its own claim (one
        thread per Pod: no episode waits for another's claim). A Pod another batch took first,
        or one with too little lifetime left, is skipped (its episode waits for another)."""

        def take_one(item: tuple[int, dict[str, Any]]) -> Claimed | None:
            index, pod = item
            at = now()
            started = read.pool_pod_started_at(pod)
            timeout = spec.episode_timeout_seconds
            patch = objects.claim_patch(pod, started, spec.batch_id, index, timeout, at)
            if patch is None:
                return None
            try:
                done = self._call(
                    "claim pool pod",
                    self.core.patch_namespaced_pod,
                    pod["metadata"]["name"],
                    namespace,
                    patch,
                )
            except (ResourceConflict, ResourceNotFound):
                return None  # another batch claimed it, or it is gone
            claimed = _claimed(done)
            self._hand_over(spec, namespace, claimed)
            return claimed

        return [c for c in self._threads(take_one, pairs) if c is not None]

    def hand_over_again(self, spec: BatchSpec, namespace: str, c: Claimed) -> None:
        """A Pod claimed by a look that died before it recorded the claim: hand it its
        episode unless its runner already has it (a runner reads one line only)."""
        if not self._handed_over(namespace, c):
            self._hand_over(spec, namespace, c)

    def _hand_over(self, spec: BatchSpec, namespace: str, c: Claimed) -> None:
        """Hand a claimed Pod its episode: directly when both sides can (`handover.py`), else
        (or when that fails) by writing it to its stdin. A Pod the line could not reach (no
        attach, no write) is deleted: its collector then records why its episode failed (never
        lost, never silent). A Pod that got its line but says nothing yet is left running."""
        line = warm.handover_line(spec, c.index)
        if self.handover_from and c.direct is not None:
            sent = handover.send(c.direct, line, CONFIRM_SECONDS)
            if sent is handover.Sent.ACKED:
                return
            # Sent without an ack: the runner may have it (a runner takes one line; its first
            # event says so), so the attach only goes to one that has not.
            if sent is handover.Sent.UNCONFIRMED and self._handed_over(namespace, c):
                return
            log.warning(
                "direct hand-over to warm Pod %s (episode %d) %s; handing over by attach",
                c.name,
                c.index,
                sent.value,
            )
        try:
            confirmed = _attach_and_write(
                self.core.api_client.configuration, namespace, c.name, line
            )
        except Exception as exc:  # no attach or no write: the episode never got its line
            log.warning(
                "hand-over to warm Pod %s (episode %d) failed: %s; deleting the Pod",
                c.name,
                c.index,
                exc,
            )
            with contextlib.suppress(BackendError):
                self._call(
                    "delete pool pod",
                    self.core.delete_namespaced_pod,
                    c.name,
                    namespace,
                    body={"preconditions": {"uid": c.uid}, "gracePeriodSeconds": 0},
                )
            return
        if not confirmed:
            log.warning(
                "warm Pod %s (episode %d) printed no event %.0f s after its hand-over",
                c.name,
                c.index,
                CONFIRM_SECONDS,
            )

    def _handed_over(self, namespace: str, c: Claimed) -> bool:
        """Whether a claimed Pod's runner already printed an event (it has its episode)."""
        try:
            text = self._text(
                "read pool pod log",
                self.core.read_namespaced_pod_log,
                c.name,
                namespace,
                container=CONTAINER_NAME,
                limit_bytes=4096,
            )
        except BackendError:
            return False
        return EVENT_KEY_MARK in text

    # -- deletion ----------------------------------------------------------------------------
    def delete_claimed(self, namespace: str, batch_id: str, warm: Sequence[WarmClaim]) -> bool:
        """Delete a batch's warm Pods after proving each is the one it claimed (UID, batch
        label). True once all are gone."""
        gone = True
        for claim in warm:
            name, uid = claim.pod, claim.uid
            try:
                found = self._call("read pool pod", self.core.read_namespaced_pod, name, namespace)
            except ResourceNotFound:
                continue
            labels = found["metadata"].get("labels") or {}
            if found["metadata"]["uid"] != uid or labels.get(k.LABEL_BATCH) != batch_id:
                raise OwnershipError(
                    f"Pod {namespace}/{name} has uid {found['metadata']['uid']} and labels "
                    f"{labels}; the receipt says uid {uid} of batch {batch_id}: refusing to "
                    "delete it"
                )
            gone = False
            if not found["metadata"].get("deletionTimestamp"):
                self._delete_pod(found)
        return gone

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ResourceNotFound, ResourceConflict):
            self._call(
                "delete pool pod",
                self.core.delete_namespaced_pod,
                meta["name"],
                meta["namespace"],
                body={"preconditions": {"uid": meta["uid"]}, "gracePeriodSeconds": 0},
            )

    def drain(self, key: str, namespace_uid: str | None) -> bool:
        """Delete the pool's idle Pods; once none of its Pods is claimed by a batch that still
        runs, delete its namespace too (after proving it by UID and labels). True once gone."""
        namespace = objects.pool_namespace(key)

        def prove(ns: dict[str, Any]) -> None:
            self._check_ours(ns, key)
            if namespace_uid is not None and ns["metadata"]["uid"] != namespace_uid:
                raise OwnershipError(
                    f"namespace {namespace} has uid {ns['metadata']['uid']}, the pool registry "
                    f"says {namespace_uid}: refusing to delete it"
                )

        def emptied(_ns: dict[str, Any]) -> bool:
            busy = False
            for pod in self.pods(key):
                labels = pod["metadata"].get("labels") or {}
                if labels.get(k.LABEL_POOL_STATE) == objects.POOL_STATE_IDLE:
                    self._delete_pod(pod)
                elif (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    busy = True  # a batch's episode runs here: its own cleanup deletes it
            return not busy and namespace_uid is not None

        return delete_namespace(self._call, self.core, namespace, "pool namespace", prove, emptied)

    def list_all(self) -> dict[str, dict[str, Any]]:
        """Pool key -> {namespace, uid, waiting, claimed_running, pods} of every pool namespace
        of ours (claimed_running: its Running Pods a batch has claimed)."""
        selector = f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE},{k.LABEL_POOL}"
        found = self._call("list namespaces", self.core.list_namespace, label_selector=selector)
        pools: dict[str, dict[str, Any]] = {}
        for ns in found.get("items", []):
            key = ns["metadata"]["labels"][k.LABEL_POOL]
            pods = self.pods(key)
            running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
            pools[key] = {
                "namespace": ns["metadata"]["name"],
                "uid": ns["metadata"]["uid"],
                "waiting": sum(1 for p in pods if read.pool_pod_waiting(p)),
                "claimed_running": sum(
                    1 for p in running if k.LABEL_BATCH in (p["metadata"].get("labels") or {})
                ),
                "pods": len(pods),
            }
        return pools


def _claimed(pod: dict[str, Any]) -> Claimed:
    meta = pod["metadata"]
    return Claimed(
        index=int(meta["labels"][k.LABEL_EPISODE_INDEX]),
        name=meta["name"],
        uid=meta["uid"],
        claimed_at=float((meta.get("annotations") or {}).get(k.ANNOTATION_CLAIMED_AT) or 0),
        direct=handover.direct_target(pod),
    )


def _threads(fn: Callable[[Any], Any], items: Any, threads: int) -> Iterator[Any]:
    items = list(items)
    if len(items) <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as executor:
        yield from executor.map(fn, items)


def _attach_and_write(
    configuration: client.Configuration, namespace: str, name: str, line: bytes
) -> bool:
    """Attach to the Pod's waiting program, write its line and wait for its first event (True
    once seen; False when none came in time). Raises when the attach or the write fails.

    A client of its own: `stream` swaps the ApiClient's transport while it connects, which
    would break any other thread using the same client."""
    with client.ApiClient(configuration) as api:
        ws = stream(
            client.CoreV1Api(api).connect_get_namespaced_pod_attach,
            name,
            namespace,
            container=CONTAINER_NAME,
            stdin=True,
            stdout=True,
            stderr=False,
            tty=False,
            _preload_content=False,
        )
        try:
            ws.write_stdin(line.decode())
            end = time.monotonic() + CONFIRM_SECONDS
            seen = ""
            while EVENT_KEY_MARK not in seen and ws.is_open():
                if time.monotonic() > end:
                    return False
                ws.update(timeout=0.5)
                if ws.peek_stdout():
                    seen += ws.read_stdout()
        finally:
            ws.close()
    return True
