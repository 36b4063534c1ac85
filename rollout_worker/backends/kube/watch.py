"""One watch per batch per worker process: every collector thread of the process waits on it.

A `PodWatch` lists a batch's Pods once, then follows them with a watch (resumed from the last
resourceVersion when the server ends it, relisted after 410 Gone or an error), and wakes the
threads waiting for an episode when its Pods change. The API reads of collection are then one
list and one watch per batch and process (plus one log read per episode), whatever the number of
episodes and however long they run. A watch nobody waited on for a while stops itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
import urllib3
from kubernetes import watch
from kubernetes.client.rest import ApiException

from rollout_wire.errors import BackendError, TransientBackendError
from rollout_worker.backends.kube.read import DELETED_MARK

log = logging.getLogger(__name__)

# Server-side timeout of one watch request; the watch then resumes from its resourceVersion.
WATCH_SECONDS = 60
# A watch with no waiter for this long stops (its batch is collected, or moved elsewhere).
IDLE_SECONDS = 120.0
# After an error, wait this long before listing again (doubling, at most RETRY_MAX_SECONDS).
RETRY_SECONDS = 0.5
RETRY_MAX_SECONDS = 8.0
# The recent events a watch remembers for its `wait_any` waiters.
MAX_CHANGES = 8192

Pods = dict[str, dict[str, Any]]  # uid -> Pod (raw JSON)
ListPods = Callable[[], dict[str, Any]]  # one list call: {"items": [...], "metadata": {...}}
WatchPods = Callable[..., Any]  # the list function, for kubernetes.watch.Watch.stream


class RawWatch(watch.Watch):
    """A watch whose events stay the dicts the API server sent (`raw_object`, parsed with
    orjson). The client's own Watch turns every event into its typed models first: on the real
    node that was two thirds of a collector's CPU (py-spy), for objects we never read."""

    def get_return_type(self, func: Any) -> None:
        return None

    def unmarshal_event(self, data: str, return_type: Any) -> dict[str, Any] | None:
        if not data or data.isspace():
            return None
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        event["raw_object"] = event.get("object")
        return dict(event)


class PodWatch:
    """The Pods of one batch, grouped by completion index, kept current by one watch."""

    def __init__(
        self,
        name: str,
        list_pods: ListPods,
        stream_args: tuple[WatchPods, tuple[Any, ...], Mapping[str, Any]],
        index_of: Callable[[dict[str, Any]], int | None],
    ) -> None:
        self.name = name
        self._list = list_pods
        self._stream_fn, self._stream_args, self._stream_kwargs = stream_args
        self._index_of = index_of
        self._by_index: dict[int, Pods] = {}
        # One lock; a condition per episode index, so a Pod event wakes only the collectors of
        # that episode (not every waiting thread of the process).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._per_index: dict[int, threading.Condition] = {}
        # For waiters on many episodes (`wait_any`): the indexes of recent events in order
        # (`_changes[0]` is event number `_changes_base`), and a count of relists.
        self._any = threading.Condition(self._lock)
        self._changes: list[int] = []
        self._changes_base = 0
        self._relists = 0
        # Per repeated caller of `wait_any` (the batch's waker): what its last call checked
        # and up to which event, so its next call checks only what is new.
        self._cursors: dict[str, tuple[int, int, frozenset[int]]] = {}
        self._synced = False
        self._error: BackendError | None = None
        self._last_wait = time.monotonic()
        self._stopped = False
        self.lists = 0  # API calls made, for tests and benchmarks
        self.watches = 0
        self._thread = threading.Thread(target=self._run, name=f"podwatch-{name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def _index_cond(self, index: int) -> threading.Condition:
        """Called with the lock held."""
        cond = self._per_index.get(index)
        if cond is None:
            cond = self._per_index[index] = threading.Condition(self._lock)
        return cond

    def _wake_all(self) -> None:
        """Called with the lock held: a relist, an error or the end concerns every waiter."""
        for cond in self._per_index.values():
            cond.notify_all()
        self._any.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._wake_all()

    def wait(self, index: int, timeout: float, done: Callable[[Pods], bool]) -> Pods:
        """The Pods of episode `index` once `done(pods)` holds, or as they are after `timeout`.

        Raises TransientBackendError when the watch cannot sync with the API server in time.
        """
        end = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._last_wait = time.monotonic()
            while True:
                if self._synced:
                    pods = dict(self._by_index.get(index, {}))
                    if done(pods):
                        return pods
                remaining = end - time.monotonic()
                if remaining <= 0:
                    if not self._synced:
                        raise TransientBackendError(
                            f"watch of {self.name} not synced: {self._error or 'starting'}"
                        )
                    return pods
                self._index_cond(index).wait(remaining)
                self._last_wait = time.monotonic()

    def wait_any(
        self,
        indexes: list[int],
        timeout: float,
        done: Callable[[int, Pods], bool],
        *,
        caller: str | None = None,
    ) -> list[int]:
        """Those of `indexes` for which `done(index, pods)` holds, waiting up to `timeout` for
        one. Each event is checked once, for its own episode; a repeated `caller` has only
        the episodes new to it and those with events since its last call checked: the cost
        does not grow with the number of episodes waited on, or with how long they run.

        Raises TransientBackendError when the watch cannot sync with the API server in time.
        """
        end = time.monotonic() + max(0.0, timeout)
        wanted = set(indexes)
        with self._cond:
            self._last_wait = time.monotonic()
            start: tuple[int, int, frozenset[int]] = (-1, 0, frozenset())  # check everything
            relists, seen, checked = self._cursors.pop(caller, start) if caller else start
            while True:
                if self._synced:
                    if relists != self._relists or seen < self._changes_base:
                        candidates = wanted  # first look, or after a relist: every episode
                    else:
                        fresh = self._changes[seen - self._changes_base :]
                        candidates = wanted.difference(checked).union(wanted.intersection(fresh))
                    relists, checked = self._relists, frozenset(wanted)
                    seen = self._changes_base + len(self._changes)
                    ended = [
                        i for i in sorted(candidates) if done(i, dict(self._by_index.get(i, {})))
                    ]
                    if ended or time.monotonic() >= end:
                        if caller is not None:
                            # Those returned stay unchecked: a caller that fails before it
                            # acts on them sees them again next call (no event will come).
                            self._cursors[caller] = (relists, seen, checked.difference(ended))
                        return ended
                remaining = end - time.monotonic()
                if remaining <= 0:
                    if not self._synced:
                        raise TransientBackendError(
                            f"watch of {self.name} not synced: {self._error or 'starting'}"
                        )
                    continue  # synced: the look above returns (and keeps the caller's cursor)
                self._any.wait(remaining)
                self._last_wait = time.monotonic()

    # -- the watch thread ----------------------------------------------------------------------
    def _idle(self) -> bool:
        return time.monotonic() - self._last_wait > IDLE_SECONDS

    def _run(self) -> None:
        delay = RETRY_SECONDS
        while not self._stopped and not self._idle():
            try:
                version = self._relist()
                delay = RETRY_SECONDS
                while not self._stopped and not self._idle():
                    version = self._follow(version)
            except _Gone:
                continue  # our resourceVersion expired: list again
            except BackendError as exc:
                with self._cond:
                    self._error = exc
                log.warning("watch of %s: %s; listing again in %.1fs", self.name, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
        with self._cond:
            self._stopped = True
            self._wake_all()

    def _relist(self) -> str:
        listing = self._list()
        self.lists += 1
        by_index: dict[int, Pods] = {}
        for pod in listing.get("items", []):
            index = self._index_of(pod)
            if index is not None:
                by_index.setdefault(index, {})[pod["metadata"]["uid"]] = pod
        with self._cond:
            self._by_index = _carry_deleted(self._by_index, by_index)
            self._relists += 1
            self._synced = True
            self._error = None
            self._wake_all()
        return str(listing["metadata"]["resourceVersion"])

    def _follow(self, version: str) -> str:
        """One watch request from `version`; returns the version to resume from."""
        stream = RawWatch()
        self.watches += 1
        try:
            for event in stream.stream(
                self._stream_fn,
                *self._stream_args,
                resource_version=version,
                timeout_seconds=WATCH_SECONDS,
                _request_timeout=WATCH_SECONDS + 15,
                allow_watch_bookmarks=True,
                **self._stream_kwargs,
            ):
                # An ERROR event never comes here: with timeout_seconds set, the client raises
                # it as an ApiException (410 included) before yielding it.
                obj = event["raw_object"]
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if event["type"] == "BOOKMARK":
                    continue
                self._apply(event["type"], obj)
                if self._stopped:
                    break
        except ApiException as exc:
            if exc.status == 410:
                raise _Gone from exc
            raise TransientBackendError(f"watch of {self.name}: {exc.status} {exc.reason}") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientBackendError(f"watch of {self.name}: {exc}") from exc
        finally:
            stream.stop()
        return version

    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        index = self._index_of(pod)
        if index is None:
            return
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            # Keep its last state: a Pod deleted mid-run is how that episode ended, and a
            # collector that was not waiting at that moment must still see it.
            pod = {**pod, DELETED_MARK: True}
        with self._cond:
            self._by_index.setdefault(index, {})[uid] = pod
            self._index_cond(index).notify_all()
            self._changes.append(index)
            if len(self._changes) > MAX_CHANGES:
                # A waiter further behind looks at all its episodes again.
                del self._changes[: MAX_CHANGES // 2]
                self._changes_base += MAX_CHANGES // 2
            self._any.notify_all()


def _carry_deleted(before: dict[int, Pods], listed: dict[int, Pods]) -> dict[int, Pods]:
    """A new listing, with each Pod known before but missing from it kept as deleted: its
    DELETED event fell in the gap the relist covers (a 410, a broken watch), and with no
    Pod at all its episode would read Pending until its deadline. Known Pods keep their
    order (`observe_pods` sorts stably on creation seconds)."""
    merged = dict(listed)
    for index, pods in before.items():
        now = listed.get(index, {})
        if any(uid not in now for uid in pods):
            kept = {uid: now.get(uid) or {**pod, DELETED_MARK: True} for uid, pod in pods.items()}
            merged[index] = kept | {uid: pod for uid, pod in now.items() if uid not in pods}
    return merged


class _Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class PodWatches:
    """The watches of one worker process, one per batch, made on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[str, PodWatch] = {}

    def get(self, name: str, make: Callable[[], PodWatch]) -> PodWatch:
        with self._lock:
            current = self._watches.get(name)
            if current is None or not current.alive:
                current = self._watches[name] = make()
            for other in [n for n, w in self._watches.items() if not w.alive]:
                del self._watches[other]
            return current
