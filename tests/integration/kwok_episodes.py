"""Episodes for batch Pods on KWOK nodes, where no container ever runs.

KWOK starts every Pod and leaves a batch Pod (label ``rollout.dev/owner=rollout``) Running until
this harness says how it ended: it annotates the Pod (:data:`OUTCOME`, :data:`EXIT_CODE`,
:data:`MESSAGE`), and the ``rollout-episode-finish`` stage in hack/localkube/kwok-stages.yaml
finishes it with exactly that phase, exit code and termination message. Its log is a CRI file
served through a KWOK ``Logs`` object, so the pipeline reads it through the API server exactly
as it reads a real Pod's log. The harness never decides an episode's reward by itself:

- **Faithful** (the default for every batch): the harness runs the Pod's own episode program
  (the ``episode.py`` of the batch's ConfigMap, as the Pod would mount it) in the local
  bubblewrap sandbox the local backend uses, with the Pod's environment (``EPISODE_ID`` from the
  Pod's name, ``ROLLOUT_ACTION`` and the rest from its spec). That run's stdout and stderr are
  the Pod's log, its exit status is the container's exit code and what it wrote to
  ``/dev/termination-log`` is the termination message.
- **Mix** (:class:`Mix`, registered per batch id before it is submitted): each Pod's fate is
  drawn from a seeded random mix (:data:`FATES`), so a test knows for every episode how it must
  be classified. Its ``ready``/``reward`` events are those of one real run of the episode
  program per action (made at start-up), renamed for the Pod and re-timed.

Only Pods on KWOK nodes are touched, and each Pod by one harness only (a claim annotation with
an optimistic-concurrency patch), so concurrent sessions and real-node tests are left alone.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rollout_wire import constants as k
from rollout_worker.backends.kube.watch import RawWatch
from rollout_worker.backends.local.sandbox import plan_sandbox
from rollout_worker.cli.stack import LocalStack
from rollout_worker.sandbox import episode_program_text
from tests.k8s import cluster as kc

#: Annotations the harness puts on a batch Pod; kwok-stages.yaml reads them.
OUTCOME = "rollout.test/outcome"  # succeeded | failed | deadline
EXIT_CODE = "rollout.test/exit-code"
MESSAGE = "rollout.test/message"  # the container's termination message
FATE = "rollout.test/fate"  # informative: the drawn fate (mix) or "episode" (faithful)
CLAIM = "rollout.test/harness"

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
CONTAINER = "episode"
PROGRAM_KEY = "episode.py"
#: Exit code of a container the kubelet kills after the grace period (python as PID 1 ignores
#: SIGTERM, so the SIGKILL ends it): what a `hang` episode past activeDeadlineSeconds shows.
KILLED_EXIT = 137
RUN_TIMEOUT_S = 120

# -- fates of the seeded mix ------------------------------------------------------------------
SUCCESS = "success"
REWARD_ZERO = "reward0-exit0"
NONZERO_EXIT = "nonzero-exit"
DEADLINE = "deadline"
DELETED = "deleted"
FORGED = "forged-episode"
TWO_REWARDS = "two-rewards"
NOT_JSON = "non-json-line"
EMPTY = "empty-log"
#: Every fate with its weight in the mix (half succeed, the rest split evenly).
FATES: dict[str, int] = {
    SUCCESS: 8,
    REWARD_ZERO: 1,
    NONZERO_EXIT: 1,
    DEADLINE: 1,
    DELETED: 1,
    FORGED: 1,
    TWO_REWARDS: 1,
    NOT_JSON: 1,
    EMPTY: 1,
}
NONZERO_EXIT_CODE = 2


@dataclass(frozen=True)
class Mix:
    """A seeded draw of one fate per episode index (independent of Pod names and timing)."""

    seed: int
    weights: tuple[tuple[str, int], ...] = tuple(FATES.items())

    def fate(self, index: int) -> str:
        names = [name for name, _ in self.weights]
        weights = [weight for _, weight in self.weights]
        return random.Random(f"{self.seed}:{index}").choices(names, weights)[0]

    def fates(self, count: int) -> list[str]:
        return [self.fate(index) for index in range(count)]


@dataclass
class RealRun:
    """One run of the episode program in the sandbox."""

    exit_code: int
    entries: list[tuple[float, str, str]]  # (time, stream, line) in arrival order
    termination_message: str

    def stdout(self) -> list[str]:
        return [line for _, stream, line in self.entries if stream == "stdout"]

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


@dataclass
class Served:
    """What the harness did with one Pod (for tests and for debugging a failure)."""

    namespace: str
    pod: str
    index: int | None
    fate: str
    exit_code: int | None = None
    run: RealRun | None = None
    error: str | None = None


# -- running the episode program --------------------------------------------------------------
def _sandbox_python() -> tuple[str, str]:
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    done = subprocess.run(
        [python, "-c", "import sys; print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return python, done.stdout.strip()


def _read_lines(pipe, stream: str, out: list, lock: threading.Lock) -> None:
    for raw in iter(pipe.readline, ""):
        with lock:
            out.append((time.time(), stream, raw.rstrip("\n")))
    pipe.close()


def run_episode(
    program: Path,
    episode_id: str,
    env: dict[str, str],
    scratch: Path,
    timeout: float = RUN_TIMEOUT_S,
) -> RealRun:
    """Run ``program`` as the Pod would: bubblewrap as the local backend plans it (own
    namespaces, uid 1000, no network, read-only system), with the Pod's ``EPISODE_ID`` and
    ``ROLLOUT_ACTION``, and a host file bound at /dev/termination-log."""
    python, prefix = _sandbox_python_cached()
    workspace = scratch / "workspace"
    workspace.mkdir(parents=True)
    termination = scratch / "termination-log"
    termination.write_text("")
    scratch.chmod(0o711)
    plan = plan_sandbox(
        isolation="bwrap",
        python=python,
        python_prefix=prefix,
        program=program,
        workspace=workspace,
        episode_id=episode_id,
        action=env.get("ROLLOUT_ACTION", "fix"),
        running_as_root=os.geteuid() == 0,
        # The rest of the Pod's literal environment; the sandbox sets its own paths.
        extra_env={
            key: value
            for key, value in env.items()
            if key not in ("EPISODE_ID", "ROLLOUT_ACTION", "ROLLOUT_WORKSPACE", "HOME", "PATH")
        },
    )
    if plan.run_as:  # root: the sandbox starts as host uid 1000, as the local backend's does
        for path in (workspace, termination):
            os.chown(path, *plan.run_as)
    argv = list(plan.argv)
    cut = argv.index("--")
    argv[cut:cut] = ["--bind", str(termination), "/dev/termination-log"]
    entries: list[tuple[float, str, str]] = []
    lock = threading.Lock()
    proc = subprocess.Popen(
        argv,
        cwd=plan.cwd,
        env=plan.env or None,
        user=plan.run_as[0] if plan.run_as else None,
        group=plan.run_as[1] if plan.run_as else None,
        extra_groups=[] if plan.run_as else None,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    readers = [
        threading.Thread(target=_read_lines, args=(proc.stdout, "stdout", entries, lock)),
        threading.Thread(target=_read_lines, args=(proc.stderr, "stderr", entries, lock)),
    ]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    for reader in readers:
        reader.join()
    return RealRun(code, entries, termination.read_text())


_PYTHON: tuple[str, str] | None = None


def _sandbox_python_cached() -> tuple[str, str]:
    global _PYTHON
    if _PYTHON is None:
        _PYTHON = _sandbox_python()
    return _PYTHON


def write_cri_entries(path: Path, entries: Iterable[tuple[float, str, str]]) -> Path:
    """Write ``(unix time, stream, line)`` entries as a CRI-format container log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for at, stream, line in entries:
            ts = _dt.datetime.fromtimestamp(at, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")
            f.write(f"{ts} {stream} F {line}\n")
    path.chmod(0o644)  # the KWOK controller (another process) reads it
    return path


def termination_summary(reward_event: dict[str, Any]) -> str:
    """The termination message the episode program writes for this reward event."""
    keys = ("at", "episode_id", "reward", "baseline_exit", "tests_exit")
    return json.dumps({key: reward_event[key] for key in keys})


# -- the harness ------------------------------------------------------------------------------
class KwokEpisodes:
    """Watches batch Pods on KWOK nodes and ends each one faithfully or by its drawn fate."""

    def __init__(
        self, cluster: kc.Cluster, directory: Path, *, api_workers: int = 16, run_slots: int = 2
    ) -> None:
        self.cluster = cluster
        # Its own client and connection pool: up to api_workers threads call the API at once.
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = api_workers + 4
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.directory = directory
        self.name = f"h-{uuid.uuid4().hex[:8]}"
        self.errors: list[str] = []
        self.served: dict[str, Served] = {}  # "namespace/pod" -> what was done
        self._mixes: dict[str, Mix] = {}  # namespace -> mix
        self._seen: set[str] = set()
        self._programs: dict[str, Path] = {}
        self._kwok_nodes: set[str] = set()
        self._lock = threading.Lock()
        self._runs = threading.Semaphore(run_slots)  # real runs at once (2 cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kwok-episodes", daemon=True)
        self._pool = ThreadPoolExecutor(api_workers, thread_name_prefix="kwok-episode")
        self.templates: dict[str, RealRun] = {}
        # Programs and workspaces of real runs: outside pytest's root-only (0700) tmp dirs.
        self.sandboxes = Path(tempfile.mkdtemp(prefix="rollout-kwok-sandboxes-"))

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> KwokEpisodes:
        self.sandboxes.chmod(0o711)  # uid 1000 must reach programs and workspaces in it
        program = self.sandboxes / "template" / PROGRAM_KEY
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text(episode_program_text())
        for action in ("fix", "none"):
            with tempfile.TemporaryDirectory(dir=self.sandboxes) as scratch:
                run = run_episode(program, "template", {"ROLLOUT_ACTION": action}, Path(scratch))
            rewards = [e for e in run.events() if e.get("event") == "reward"]
            if len(rewards) != 1:
                raise RuntimeError(f"the episode program ({action}) printed {run.entries}")
            self.templates[action] = run
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.api.close()
        shutil.rmtree(self.sandboxes, ignore_errors=True)

    def use_mix(self, batch_id: str, mix: Mix) -> str:
        """Serve the batch ``batch_id`` (submit it with this id) by ``mix``'s draws; returns
        the batch id."""
        with self._lock:
            self._mixes[f"rollout-{batch_id}"] = mix
        return batch_id

    def served_in(self, namespace: str) -> dict[str, Served]:
        prefix = f"{namespace}/"
        with self._lock:
            return {key: s for key, s in self.served.items() if key.startswith(prefix)}

    # -- watching ------------------------------------------------------------------------------
    def _watch(self) -> None:
        # Only Running batch Pods matter; events stay plain JSON (no model deserialisation) and
        # the watch resumes from the last resourceVersion instead of listing again: with
        # thousands of Pods in the cluster, relisting and decoding them starved the harness.
        selector = f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE}"
        resource_version: str | None = None
        while not self._stop.is_set():
            # RawWatch, not the client's Watch with deserialize=False: that one fails with a
            # KeyError on the 410 ERROR event of an expired resourceVersion instead of raising
            # ApiException(410), and the harness counted it as an error.
            stream = RawWatch()
            kwargs: dict[str, Any] = {
                "label_selector": selector,
                "field_selector": "status.phase=Running",
                "timeout_seconds": 5,
            }
            if resource_version:
                kwargs["resource_version"] = resource_version
            try:
                for event in stream.stream(self.core.list_pod_for_all_namespaces, **kwargs):
                    pod = event.get("object") or {}
                    resource_version = (pod.get("metadata") or {}).get(
                        "resourceVersion", resource_version
                    )
                    if event["type"] in ("ADDED", "MODIFIED") and self._ready_to_serve(pod):
                        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                        if key not in self._seen:
                            self._seen.add(key)
                            self._pool.submit(self._serve_safely, pod)
                    if self._stop.is_set():
                        break
            except ApiException as exc:
                if exc.status != 410:
                    self.errors.append(f"watch: {exc.status} {exc.reason}")
                resource_version = None
                time.sleep(0.5)
            except (OSError, KeyError, ValueError) as exc:
                self.errors.append(f"watch: {type(exc).__name__}: {exc}")
                resource_version = None
                time.sleep(0.5)
            except RuntimeError:  # the pool shut down under us
                break
            finally:
                stream.stop()

    def _ready_to_serve(self, pod: dict[str, Any]) -> bool:
        meta, status = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            return False
        if CLAIM in (meta.get("annotations") or {}):
            return False  # another harness (or an earlier watch of ours) has it
        # Batch Pods only (a Job's completion index), never another session's probe Pod.
        if "batch.kubernetes.io/job-completion-index" not in (meta.get("labels") or {}):
            return False
        return self._on_kwok_node((pod.get("spec") or {}).get("nodeName"))

    def _on_kwok_node(self, node: str | None) -> bool:
        if not node:
            return False
        if node not in self._kwok_nodes:
            try:
                nodes = self.core.list_node(label_selector="type=kwok").items
            except ApiException:
                return False
            self._kwok_nodes = {n.metadata.name for n in nodes}
        return node in self._kwok_nodes

    # -- serving one Pod -----------------------------------------------------------------------
    def _serve_safely(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        try:
            if self._claim(meta["namespace"], meta["name"]):
                self._serve(pod)
        except ApiException as exc:
            # The run was deleted under us (a test's cleanup): nothing left to serve.
            if exc.status == 404 or "NamespaceTerminating" in (exc.body or ""):
                return
            self.errors.append(f"{key}: {exc.status} {exc.reason}: {exc.body}")
        except Exception as exc:  # recorded; a test asserts harness.errors is empty
            self.errors.append(f"{key}: {type(exc).__name__}: {exc}")

    def _claim(self, namespace: str, name: str) -> bool:
        """Mark the Pod as ours with an optimistic-concurrency patch; False if another
        harness got it first."""
        for _ in range(20):
            try:
                pod = self.core.read_namespaced_pod(name, namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
            if CLAIM in (pod.metadata.annotations or {}):
                return pod.metadata.annotations[CLAIM] == self.name
            patch = {
                "metadata": {
                    "resourceVersion": pod.metadata.resource_version,
                    "annotations": {CLAIM: self.name},
                }
            }
            try:
                self.core.patch_namespaced_pod(name, namespace, patch)
                return True
            except ApiException as exc:
                if exc.status == 404:
                    return False
                if exc.status != 409:
                    raise
        raise RuntimeError(f"could not claim {namespace}/{name}: kept conflicting")

    def _serve(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        raw_index = (meta.get("labels") or {}).get(INDEX_LABEL)
        index = int(raw_index) if raw_index is not None else None
        with self._lock:
            mix = self._mixes.get(namespace)
        log_path = self.directory / namespace / f"{name}.log"
        if mix is None or index is None:
            served = self._faithful(pod, log_path)
        else:
            served = self._drawn(namespace, name, index, mix.fate(index), log_path)
        with self._lock:
            self.served[f"{namespace}/{name}"] = served

    def _faithful(self, pod: dict[str, Any], log_path: Path) -> Served:
        meta = pod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        container = next(c for c in pod["spec"]["containers"] if c["name"] == CONTAINER)
        env = {}
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = var["value"]
            elif (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == (
                "metadata.name"
            ):
                env[var["name"]] = name
        program = self._program(namespace, pod)
        with self._runs, tempfile.TemporaryDirectory(dir=self.sandboxes) as scratch:
            run = run_episode(program, env.get("EPISODE_ID", name), env, Path(scratch))
        write_cri_entries(log_path, run.entries)
        self._serve_log(namespace, name, log_path)
        outcome = "succeeded" if run.exit_code == 0 else "failed"
        self._finish(namespace, name, outcome, run.exit_code, run.termination_message, "episode")
        index = (meta.get("labels") or {}).get(INDEX_LABEL)
        return Served(namespace, name, int(index) if index else None, "episode", run.exit_code, run)

    def _program(self, namespace: str, pod: dict[str, Any]) -> Path:
        """The episode program the Pod mounts: its ConfigMap volume, fetched once per batch."""
        with self._lock:
            cached = self._programs.get(namespace)
        if cached is not None:
            return cached
        volume = next(v for v in pod["spec"].get("volumes") or [] if "configMap" in v)
        cm = self.core.read_namespaced_config_map(volume["configMap"]["name"], namespace)
        path = self.sandboxes / namespace / PROGRAM_KEY
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside, then renamed into place: two Pods of a batch served at once both miss
        # the cache, and a second write in place truncated the program under the first Pod's
        # run (a cold CI's episode died of a SyntaxError at the cut).
        aside = path.with_name(f".{PROGRAM_KEY}.{threading.get_ident()}")
        aside.write_text(cm.data[PROGRAM_KEY])
        aside.chmod(0o644)
        os.replace(aside, path)
        with self._lock:
            self._programs[namespace] = path
        return path

    def _drawn(self, namespace: str, name: str, index: int, fate: str, log_path: Path) -> Served:
        now = time.time()
        ready = {"event": "ready", "at": now, "episode_id": name}

        def reward(action: str, at: float, episode_id: str = name) -> dict[str, Any]:
            template = next(
                e for e in self.templates[action].events() if e.get("event") == "reward"
            )
            return {**template, "at": at, "episode_id": episode_id}

        good = reward("fix", now + 0.05)
        lines: list[str] = [json.dumps(ready), json.dumps(good)]
        outcome, exit_code, message = "succeeded", 0, termination_summary(good)
        if fate == REWARD_ZERO:
            bad = reward("none", now + 0.05)
            lines = [json.dumps(ready), json.dumps(bad)]
            message = termination_summary(bad)
        elif fate == NONZERO_EXIT:
            outcome, exit_code = "failed", NONZERO_EXIT_CODE
        elif fate == DEADLINE:
            lines = [json.dumps(ready)]
            outcome, exit_code, message = "deadline", KILLED_EXIT, ""
        elif fate == DELETED:
            lines = [json.dumps(ready)]
        elif fate == FORGED:
            forged = reward("fix", now + 0.05, f"rollout-{index + 1}-forged")
            lines = [json.dumps(ready), json.dumps(forged)]
        elif fate == TWO_REWARDS:
            lines = [json.dumps(ready), json.dumps(good), json.dumps(reward("fix", now + 0.06))]
        elif fate == NOT_JSON:
            lines = [json.dumps(ready), "Traceback (most recent call last):", json.dumps(good)]
        elif fate == EMPTY:
            lines = []
        entries = [(now + i * 0.001, "stdout", line) for i, line in enumerate(lines)]
        write_cri_entries(log_path, entries)
        self._serve_log(namespace, name, log_path)
        if fate == DELETED:
            time.sleep(0.5)  # mid-run: started, printed `ready`, then deleted through the API
            try:
                self.core.delete_namespaced_pod(name, namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
            return Served(namespace, name, index, fate)
        self._finish(namespace, name, outcome, exit_code, message, fate)
        return Served(namespace, name, index, fate, exit_code)

    def _serve_log(self, namespace: str, name: str, path: Path) -> None:
        body = {
            "apiVersion": f"{kc.KWOK_GROUP}/{kc.KWOK_VERSION}",
            "kind": "Logs",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"logs": [{"logsFile": str(path.resolve()), "follow": False}]},
        }
        try:
            self.custom.create_namespaced_custom_object(
                kc.KWOK_GROUP, kc.KWOK_VERSION, namespace, "logs", body
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    def _finish(
        self, namespace: str, name: str, outcome: str, exit_code: int, message: str, fate: str
    ) -> None:
        """Annotate the Pod; the rollout-episode-finish stage ends it accordingly."""
        patch = {
            "metadata": {
                "annotations": {
                    FATE: fate,
                    EXIT_CODE: str(exit_code),
                    MESSAGE: message,
                    OUTCOME: outcome,
                }
            }
        }
        self.core.patch_namespaced_pod(name, namespace, patch)


#: The old name (benchmarks/bench_kubernetes.py): every batch is now served faithfully.
SimulatedEpisodes = KwokEpisodes


# -- classifying a report row -----------------------------------------------------------------
#: Error categories of a report row, by what its error strings say (validation.py's wording).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("deadline", "DeadlineExceeded"),
    ("deleted", "delet"),
    ("phase", "sandbox phase is "),
    ("exit", "exit code "),
    ("restart", "container restarted"),
    ("not-json", "is not a JSON event"),
    ("not-event", "is not an event object"),
    ("event-count", "expected exactly one ready and one reward event"),
    ("forged", "event names episode"),
    ("reward", "reward is "),
    ("tests-exit", "tests_exit is "),
    ("baseline", "baseline_exit is "),
    ("no-timestamp", "numeric 'at' timestamp"),
    ("time-order", "time order violated"),
    ("termination-unmatched", "termination message reports an outcome the log does not contain"),
    ("termination-disagrees", "disagrees with the log"),
    ("termination-not-json", "termination message is not JSON"),
    ("lost-deadline", "(deadline) and the collection grace period"),
    ("backend", "the backend kept failing"),
)


def categories(errors: Iterable[str]) -> set[str]:
    """The categories named by a row's errors ("other" for an error no category matches)."""
    found: set[str] = set()
    for error in errors:
        hits = {name for name, needle in CATEGORIES if needle.lower() in error.lower()}
        found |= hits or {"other"}
    return found


#: How the pipeline must classify each fate: (status, the exact error categories).
EXPECTED: dict[str, tuple[str, frozenset[str]]] = {
    SUCCESS: ("ok", frozenset()),
    # The log says reward 0 (tests still failing) and the Pod exited 0.
    REWARD_ZERO: ("failed", frozenset({"reward", "tests-exit"})),
    # A rewarded log and a matching termination message, but the container exited 2.
    NONZERO_EXIT: ("failed", frozenset({"phase", "exit"})),
    # Killed at activeDeadlineSeconds after `ready`: the cause must be named.
    DEADLINE: ("failed", frozenset({"phase", "deadline", "exit", "event-count"})),
    # Deleted through the API mid-run: the Pod ended Failed (killed) and the row must say it
    # was deleted (as tests/integration/test_real_failures.py asks on the real node).
    DELETED: ("failed", frozenset({"phase", "deleted", "exit", "event-count"})),
    # The reward event names another episode; the termination message names this one.
    FORGED: ("failed", frozenset({"forged", "termination-disagrees"})),
    # Two reward events; the termination message then matches no single one.
    TWO_REWARDS: ("failed", frozenset({"event-count", "termination-unmatched"})),
    NOT_JSON: ("failed", frozenset({"not-json"})),
    # Nothing on stdout, but the termination message carries an outcome.
    EMPTY: ("failed", frozenset({"event-count", "termination-unmatched"})),
}


#: Categories a fate may add to its exact set. A Pod deleted mid-run can be replaced by its Job
#: controller within the same second (creationTimestamp has 1 s resolution); the row then also
#: names that second Pod of the index as a restart. It stays failed with reward 0 either way.
MAY_ADD: dict[str, frozenset[str]] = {DELETED: frozenset({"restart"})}


def misclassified(report: dict[str, Any], fates: list[str]) -> list[str]:
    """Every episode whose row differs from what its drawn fate must give, explained."""
    problems = []
    rows = {row["index"]: row for row in report["pods"]}
    for index, fate in enumerate(fates):
        row = rows.get(index)
        if row is None:
            problems.append(f"episode {index} ({fate}): no row")
            continue
        status, cats = EXPECTED[fate]
        got = categories(row["errors"])
        want_reward = 1 if fate == SUCCESS else 0
        exact = got == cats or (got - cats <= MAY_ADD.get(fate, frozenset()) and cats <= got)
        if row["status"] != status or not exact or row["reward"] != want_reward:
            problems.append(
                f"episode {index} ({fate}): expected {status} {sorted(cats)} reward "
                f"{want_reward}, got {row['status']} {sorted(got)} reward {row['reward']}: "
                f"{row['errors']}"
            )
    return problems


def classification_problems(report: dict[str, Any], fates: list[str]) -> list[str]:
    """Everything in ``report`` that does not follow from the drawn ``fates`` (empty if the
    report classifies every episode exactly as drawn)."""
    count = len(fates)
    problems = []
    if report.get("episodes") != count:
        problems.append(f"report has {report.get('episodes')} episodes, drawn {count}")
    indexes = sorted(row["index"] for row in report.get("pods", []))
    if indexes != list(range(count)):
        problems.append(f"rows for indexes {indexes[:10]}..., expected each of 0..{count - 1} once")
    wrong = misclassified(report, fates)
    if wrong:
        by_fate = Counter(p.split("(", 1)[1].split(")", 1)[0] for p in wrong)
        firsts = [next(p for p in wrong if f"({fate})" in p) for fate in by_fate]
        problems.append(
            f"{len(wrong)} of {count} episodes misclassified, by fate {dict(by_fate)}; first of "
            "each:\n  " + "\n  ".join(firsts)
        )
    successes = sum(1 for fate in fates if fate == SUCCESS)
    statuses = Counter(EXPECTED[fate][0] for fate in fates)
    want = (successes, successes, statuses["failed"], statuses["lost"])
    got = tuple(
        report.get(key)
        for key in ("reward_sum", "successful_episodes", "failed_episodes", "lost_episodes")
    )
    if got != want:
        problems.append(f"reward_sum/ok/failed/lost are {got}, drawn {want}")
    return problems


def describe_mix(report: dict[str, Any], fates: list[str], seconds: float) -> str:
    return (
        f"{len(fates)} episodes in {seconds:.0f}s, drawn {dict(Counter(fates))}; report: "
        f"status={report.get('status')} ok/failed/lost={report.get('successful_episodes')}/"
        f"{report.get('failed_episodes')}/{report.get('lost_episodes')} "
        f"reward_sum={report.get('reward_sum')}"
    )


def describe_timing(report: dict[str, Any], fates: list[str], submitted_at: float) -> str:
    """Where a batch's time went, in seconds after ``submitted_at`` (wall clock): its last Pod
    created, finished and collected, its report, and the episode collected longest after it
    finished (a slow run then says whether the Pods, the collectors or the report lagged)."""
    rows = report.get("pods") or []

    def last(key: str) -> str:
        values = [row[key] for row in rows if row.get(key) is not None]
        return f"{max(values) - submitted_at:.1f}" if values else "-"

    lags = [
        (row["collected_at"] - row["finished_at"], row["index"])
        for row in rows
        if row.get("collected_at") is not None and row.get("finished_at") is not None
    ]
    worst = ""
    if lags:
        lag, index = max(lags)
        worst = f"; slowest collect {lag:.1f}s after its end (episode {index}, {fates[index]})"
    reported = report.get("reported_at")
    return (
        f"created<={last('created_at')} finished<={last('finished_at')} "
        f"collected<={last('collected_at')} reported="
        f"{reported - submitted_at if reported else float('nan'):.1f} "
        f"by {report.get('finalized_by')}{worst}"
    )


# -- the cluster's stages --------------------------------------------------------------------
class StagesMismatch(RuntimeError):
    """The KWOK controller does not run hack/localkube/kwok-stages.yaml's stages."""


def verify_stages(cluster: kc.Cluster, *, hold: float = 6.0, timeout: float = 30.0) -> None:
    """Prove the KWOK controller runs this clone's stages: a probe batch Pod on a KWOK node
    stays Running without the harness's annotations (``hold`` seconds, longer than the old
    stages' 4.5 s), then ends exactly as annotated (exit code and termination message).

    Raises StagesMismatch otherwise (e.g. the cluster was created from an older
    kwok-stages.yaml, or its KWOK controller is not running).
    """
    namespace = kc.create_test_namespace(cluster, "kwok-stages")
    name = "stage-probe"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {k.LABEL_OWNER: k.LABEL_OWNER_VALUE}},
        "spec": {
            **kc.kwok_placement(),
            "containers": [{"name": CONTAINER, "image": "probe"}],
            "restartPolicy": "Never",
        },
    }
    how = "run `hack/localkube/cluster.sh up` (it recreates a cluster whose config is stale)"
    try:
        cluster.core.create_namespaced_pod(namespace, pod)

        def phase() -> str | None:
            return cluster.core.read_namespaced_pod_status(name, namespace).status.phase

        try:
            kc.wait_for(lambda: phase() == "Running", timeout, "the probe Pod Running")
        except TimeoutError as exc:
            raise StagesMismatch(f"KWOK did not start a batch Pod: {exc}; {how}") from exc
        end = time.monotonic() + hold
        while time.monotonic() < end:
            if phase() != "Running":
                raise StagesMismatch(
                    f"a batch Pod without {OUTCOME} ended by itself ({phase()}): the cluster "
                    f"runs other KWOK stages than hack/localkube/kwok-stages.yaml; {how}"
                )
            time.sleep(0.5)
        message = '{"probe": 1}'
        annotations = {FATE: "probe", EXIT_CODE: "3", MESSAGE: message, OUTCOME: "failed"}
        patch = {"metadata": {"annotations": annotations}}
        cluster.core.patch_namespaced_pod(name, namespace, patch)
        try:
            kc.wait_for(lambda: phase() == "Failed", timeout, "the annotated probe Pod to end")
        except TimeoutError as exc:
            raise StagesMismatch(f"an annotated batch Pod did not end: {exc}; {how}") from exc
        status = cluster.core.read_namespaced_pod_status(name, namespace).status
        terminated = status.container_statuses[0].state.terminated
        if (terminated.exit_code, terminated.message) != (3, message):
            raise StagesMismatch(
                f"the probe ended with exit code {terminated.exit_code} and message "
                f"{terminated.message!r}, annotated 3 and {message!r}; {how}"
            )
    finally:
        kc.delete_namespace(cluster, namespace)


# -- fixtures shared by the KWOK test modules (import them into a test module) ----------------
RUNTIME_CLASS = "rollout-kwok"
OVERHEAD = {"cpu": "10m", "memory": "64Mi"}


@pytest.fixture(scope="module", name="kwok_runtime")
def kwok_runtime_fixture(k8s_cluster, kwok_nodes):
    return ensure_kwok_runtime(k8s_cluster)


def ensure_kwok_runtime(cluster) -> str:
    """The KWOK RuntimeClass, with the overhead the tests' capacity arithmetic expects. One
    left on a long-lived cluster with other fields (an older benchmark made it without
    overhead) is replaced: RuntimeClass fields cannot be updated in place."""
    api = client.NodeV1Api(cluster.api_client)
    body = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": RUNTIME_CLASS},
        "handler": "kwok",
        "overhead": {"podFixed": OVERHEAD},
    }
    for _ in range(30):
        try:
            api.create_runtime_class(body)
            return RUNTIME_CLASS
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = api.read_runtime_class(RUNTIME_CLASS)
        fixed = (existing.overhead.pod_fixed if existing.overhead else None) or {}
        if existing.handler == "kwok" and fixed == OVERHEAD:
            return RUNTIME_CLASS
        with contextlib.suppress(ApiException):
            api.delete_runtime_class(RUNTIME_CLASS)
        time.sleep(1)
    raise RuntimeError(f"RuntimeClass {RUNTIME_CLASS} could not be set to {OVERHEAD}")


@pytest.fixture(scope="module", name="kube_stack")
def kube_stack_fixture(k8s_cluster):
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig), "ROLLOUT_COLLECT_BLOCK_SECONDS": "2"}
    with LocalStack(collectors=2, collect_concurrency=16, extra_env=env) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module", name="episodes")
def episodes_fixture(k8s_cluster, kwok_nodes, tmp_path_factory):
    # The KWOK controller runs this clone's stages: kwok_nodes (session) proved it with
    # verify_stages before any module's harness starts, and nothing here changes the cluster.
    with KwokEpisodes(k8s_cluster, tmp_path_factory.mktemp("kwok-episodes")) as harness:
        yield harness
    assert not harness.errors, harness.errors[:10]


def kwok_request(runtime: str, **changes: Any) -> dict[str, Any]:
    placement = kc.kwok_placement()
    return {
        "backend": "kubernetes",
        "runtime": runtime,
        "capacity_check": "error",
        "node_selector": placement["nodeSelector"],
        "tolerations": placement["tolerations"],
        **changes,
    }


def new_batch_id() -> str:
    return uuid.uuid4().hex[:16]
