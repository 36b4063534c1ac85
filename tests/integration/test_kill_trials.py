"""Worker faults as repeated trials (issue 13): SIGKILL of a collector, of the control worker's
main process (its process group: main and pool children) and of one prefork child of the control
worker, at a seeded random moment of a batch, on the local backend and on Kubernetes (KWOK nodes,
episodes served by tests/integration/kwok_episodes.py).

A replacement worker on the same queue starts at once after each kill (for a prefork child the
surviving main process forks the replacement child itself). Every batch must then complete with
each episode counted exactly once, within RECOVERY_LIMIT_S of the replacement starting, with
the default reliability settings (visibility timeout 40 s, kombu's unacked restore sweep every
10 s): nothing here shortens the real recovery path.

Each backend's three kinds share one stack (started by the first of them, stopped when the other
backend's starts or the module ends; a test that fails leaves the next kind a new one) and its
calibration. Where the kills land: two batches without a kill are run first on a new stack and
the second is timed; trial i of the j-th kind then kills at a seeded random moment of window
i + j (cycling): while `submit_batch` runs (between its receipt and the chord's publication:
the worst case for the control worker, whose unacknowledged submit then comes back only after
the visibility timeout), during the collection, and in the last second before the report (the
last rows and the chord callback).

Every kill must land before the batch's report, or the trial would prove no recovery: once the
victim is dead the report must still be absent. A batch whose report was already out is not
counted: the trial runs again on a new batch, its delay halved towards its window's start
(which is before the report by construction) and at least half CALLBACK_WINDOW_S before the
report that batch had, at most ATTEMPTS times; then the trial fails.

Each trial prints: backend, kind, delay after submit, where the batch was at the kill, and the
recovery time (replacement start -> report seen by the trainer). The module ends with the
number of trials and the worst recovery per kind.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_wire import codec
from rollout_wire import constants as k
from rollout_wire.errors import BatchTimeout
from rollout_worker.cli.stack import LocalStack, WorkerProc
from tests.integration.kwok_episodes import (  # noqa: F401 - fixtures
    SUCCESS,
    Mix,
    episodes_fixture,
    kwok_request,
    kwok_runtime_fixture,
    new_batch_id,
)
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

#: A batch completes within this long after the replacement worker started.
RECOVERY_LIMIT_S = 60.0
#: Longest the test waits for a report before it says the batch never completed.
REPORT_TIMEOUT_S = 150.0
#: A deleted run's receipt says `deleted` within this long after its report.
CLEANUP_TIMEOUT_S = 120.0
# Two per kind keeps the suite's time; the windows are offset by kind (run_trials), so each
# backend still has every window hit twice. ROLLOUT_KILL_TRIALS=3 gives each kind all three.
TRIALS = int(os.environ.get("ROLLOUT_KILL_TRIALS", "2"))
#: Batches one trial may take until its kill lands before the report (see the module doc).
ATTEMPTS = 4
#: The last window: this long before the calibration batch's report.
CALLBACK_WINDOW_S = 1.0
#: Per test: two calibration batches, then per trial a batch (or a few) and a recovery of up
#: to a minute (a killed control worker's submit comes back after the visibility timeout).
TRIALS_TIMEOUT_S = 300 + 200 * TRIALS
SEED = int(os.environ.get("ROLLOUT_KILL_SEED", "13"))
COUNT = 12
KINDS = ("collector", "control-main", "prefork-child")


@dataclass
class Trial:
    backend: str
    kind: str
    number: int
    delay: float
    batch_id: str = ""
    attempts: int = 0  # batches it took for the kill to land before the report
    at_kill: str = ""
    victim: str = ""
    recovery: float | None = None  # replacement start -> report
    submit_to_report: float | None = None
    finalized_by: str = ""
    cleanup: str = ""
    cleanup_seconds: float | None = None
    problem: str = ""

    def line(self) -> str:
        rec = "-" if self.recovery is None else f"{self.recovery:6.1f}s"
        total = "-" if self.submit_to_report is None else f"{self.submit_to_report:5.1f}s"
        return (
            f"{self.backend:10} {self.kind:13} #{self.number} delay {self.delay:5.2f}s "
            f"(attempt {self.attempts}) "
            f"at kill: {self.at_kill:24} victim {self.victim:14} recovery {rec} "
            f"(submit->report {total}, by {self.finalized_by or '-'}, cleanup {self.cleanup})"
            + (" FAILED" if self.problem else "")
        )


RESULTS: list[Trial] = []

Window = tuple[str, float, float]


class SharedStack:
    """One backend's stack and its calibration windows, kept from one kind's test to the next:
    the three kinds run their trials on the stack the first of them started (its workers as
    the kills before left them: replacements on the same queues) and aim at the windows the
    first timed. One stack runs at a time: asking for another backend's stops this one."""

    def __init__(self) -> None:
        self.backend = ""
        self.stack: LocalStack | None = None
        self.windows: list[Window] | None = None

    def get(self, backend: str, make: Callable[[], LocalStack]) -> LocalStack:
        if self.stack is None or self.backend != backend:
            self.close()
            stack = make().start()
            try:
                stack.wait_ready()
            except BaseException:
                stack.stop()
                raise
            self.backend, self.stack = backend, stack
        return self.stack

    def close(self) -> None:
        stack, self.stack, self.backend, self.windows = self.stack, None, "", None
        if stack is not None:
            stack.stop()


@pytest.fixture(scope="module")
def shared_stack() -> Iterator[SharedStack]:
    shared = SharedStack()
    try:
        yield shared
    finally:
        shared.close()


def stack_for(
    request: pytest.FixtureRequest, shared: SharedStack, backend: str, make
) -> Iterator[LocalStack]:
    failed = request.session.testsfailed
    yield shared.get(backend, make)
    if request.session.testsfailed != failed:
        # This kind failed (its report is in by now): the next one starts on a new stack,
        # calibrated afresh, whatever state this one was left in.
        shared.close()


@pytest.fixture(scope="module", autouse=True)
def kill_summary(request) -> Iterator[None]:
    yield
    if not RESULTS:
        return
    lines = ["", f"kill trials: {len(RESULTS)} (seed {SEED})"]
    lines += [t.line() for t in RESULTS]
    for backend in sorted({t.backend for t in RESULTS}):
        for kind in KINDS:
            times = [
                t.recovery
                for t in RESULTS
                if (t.backend, t.kind) == (backend, kind) and t.recovery is not None
            ]
            if times:
                lines.append(
                    f"worst recovery {backend} {kind}: {max(times):.1f}s over {len(times)} trials"
                )
    measured = [t.recovery for t in RESULTS if t.recovery is not None]
    if measured:
        lines.append(f"worst recovery overall: {max(measured):.1f}s over {len(RESULTS)} trials")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)


# -- the kill --------------------------------------------------------------------------------
def where(client: RolloutClient, batch_id: str, count: int) -> str:
    """Where the batch is, read from Redis the moment before the kill."""
    r = client.redis
    if r.exists(k.report_key(batch_id)):
        receipt = client.receipt(batch_id)
        return f"reported, cleanup {receipt.get('cleanup')}"
    receipt = client.receipt(batch_id)
    if not receipt:
        return "submit queued"
    if not receipt.get("run"):
        return "submit: starting run"
    if not r.exists(k.flag_key(batch_id, "chord")):
        return "submit: chord publish"
    rows = r.hlen(k.episodes_key(batch_id))
    if rows < count:
        return f"collecting {rows}/{count}"
    return "chord callback"


def live(stack: LocalStack, queue: str) -> list[WorkerProc]:
    return [w for w in stack.workers if w.queue == queue and w.proc.poll() is None]


def dead(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_dead(pids: list[int], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not all(dead(pid) for pid in pids):
        assert time.monotonic() < end, f"processes {pids} still alive {timeout:.0f}s after SIGKILL"
        time.sleep(0.005)


def kill_and_replace(
    stack: LocalStack, kind: str, rng: random.Random, tag: str
) -> tuple[str, float]:
    """SIGKILL the victim of `kind` and wait until every process killed has ended; start its
    replacement at once. Returns (victim, the monotonic time the replacement started)."""
    if kind == "prefork-child":
        (control,) = live(stack, k.QUEUE_CONTROL)
        children = stack.pool_children(control)
        assert children, f"control worker {control.proc.pid} has no pool children"
        child = rng.choice(children)
        os.kill(child, signal.SIGKILL)
        wait_dead([child])
        # The main process lives on and forks the replacement child itself.
        return f"child {child}", time.monotonic()
    queue = k.QUEUE_COLLECT if kind == "collector" else k.QUEUE_CONTROL
    victim = rng.choice(live(stack, queue))
    children = stack.pool_children(victim)
    os.killpg(victim.proc.pid, signal.SIGKILL)  # the main process and its children
    victim.proc.wait(10)
    wait_dead(children)
    stack.workers.remove(victim)
    if queue == k.QUEUE_COLLECT:
        stack.start_worker(
            queue, f"collect-{tag}", pool="threads", concurrency=stack.collect_concurrency
        )
    else:
        stack.start_worker(
            queue, f"control-{tag}", pool="prefork", concurrency=stack.control_concurrency
        )
    return victim.name, time.monotonic()


def check_counted_once(client: RolloutClient, report: dict, count: int) -> None:
    batch_id = report["batch_id"]
    assert report["episodes"] == report["collected_episodes"] == count, (
        report["episodes"],
        report["collected_episodes"],
    )
    indexes = sorted(row["index"] for row in report["pods"])
    assert indexes == list(range(count)), indexes
    assert report["ok"] is True, report["errors"]
    assert report["successful_episodes"] == count and report["reward_sum"] == count
    entries = [codec.decode_entry(d) for _, d in client.redis.xrange(k.stream_key(batch_id))]
    episode_indexes = sorted(e.index for e in entries if e.type == k.ENTRY_EPISODE)
    assert episode_indexes == list(range(count)), episode_indexes
    reports = [e for e in entries if e.type == k.ENTRY_REPORT]
    assert len(reports) == 1, reports
    assert client.redis.hlen(k.episodes_key(batch_id)) == count


def calibrate(client: RolloutClient, submit) -> list[Window]:
    """Run one batch without a kill and time its phases (seconds after submit); returns the
    windows kill delays are drawn from, each ending before the report: `submit_batch` running
    (receipt written -> chord published: the run starts, the chord goes out), the collection,
    and the last CALLBACK_WINDOW_S before the report (the last rows, the chord callback). The
    first window is anchored on the receipt appearing in Redis (the moment the control worker
    holds the submit), the others on the submit."""
    start = time.monotonic()
    batch_id = submit(client)
    r = client.redis
    marks: dict[str, float] = {}
    while "deleted" not in marks:
        assert time.monotonic() - start < REPORT_TIMEOUT_S + CLEANUP_TIMEOUT_S, (batch_id, marks)
        now = time.monotonic() - start
        if "receipt" not in marks and r.exists(k.receipt_key(batch_id)):
            marks["receipt"] = now
        if "chord" not in marks and r.exists(k.flag_key(batch_id, "chord")):
            marks["chord"] = now
        if "report" not in marks and r.exists(k.report_key(batch_id)):
            marks["report"] = now
        if "report" in marks and client.receipt(batch_id).get("cleanup") == "deleted":
            marks["deleted"] = now
        time.sleep(0.02)
    check_counted_once(client, client.wait(batch_id, timeout=1), COUNT)
    print("calibration: " + ", ".join(f"{name} {at:.2f}s" for name, at in marks.items()))
    receipt = marks.get("receipt", 0.0)
    chord, report = marks.get("chord", receipt), marks["report"]
    return [
        ("submit", 0.0, chord - receipt),
        ("collection", chord, report),
        ("callback", max(chord, report - CALLBACK_WINDOW_S), report),
    ]


def wait_for_receipt(client: RolloutClient, batch_id: str) -> float:
    """The monotonic time the batch's receipt appeared (submit_batch is running)."""
    end = time.monotonic() + REPORT_TIMEOUT_S
    while not client.redis.exists(k.receipt_key(batch_id)):
        assert time.monotonic() < end, f"{batch_id}: submit_batch never wrote the receipt"
        time.sleep(0.005)
    return time.monotonic()


def kill_before_report(
    stack: LocalStack,
    client: RolloutClient,
    trial: Trial,
    submit,
    rng: random.Random,
    window: Window,
    delay: float,
    abandoned: list[str],
) -> tuple[float, float]:
    """Submit a batch and kill the trial's victim `delay` into its window, until the kill lands
    before the batch's report (ATTEMPTS batches at most, each delay half way back to the
    window's start, and before the report of the batch just abandoned). Batches whose report
    was out at the kill go to `abandoned` (they are checked, and their runs must be deleted
    too). Returns (submitted, replaced): the monotonic times of the counted batch's submit and
    of its replacement worker's start."""
    name, low, high = window
    while True:
        trial.attempts += 1
        stack.wait_ready()  # the previous kill's replacement is up
        submitted = time.monotonic()
        trial.batch_id = submit(client)
        anchor = submitted
        if name == "submit":  # from the moment submit_batch wrote the receipt
            anchor = wait_for_receipt(client, trial.batch_id)
        anchor_wall = time.time() - (time.monotonic() - anchor)
        time.sleep(max(0.0, anchor + delay - time.monotonic()))
        trial.delay = time.monotonic() - submitted
        trial.at_kill = where(client, trial.batch_id, COUNT)
        trial.victim, replaced = kill_and_replace(
            stack,
            kind=trial.kind,
            rng=rng,
            tag=f"{trial.backend[:4]}{trial.kind[:4]}{trial.number}-{trial.attempts}",
        )
        # Every process killed has ended: a report now was published before the kill, or
        # since by a surviving worker. Not told apart, both count as too late.
        if not client.redis.exists(k.report_key(trial.batch_id)):
            return submitted, replaced
        print(f"{trial.line()}: the report was out at the kill, again", flush=True)
        abandoned.append(trial.batch_id)
        report = client.wait(trial.batch_id, REPORT_TIMEOUT_S)
        check_counted_once(client, report, COUNT)
        assert trial.attempts < ATTEMPTS, (
            f"{ATTEMPTS} kills in window {name!r} ({low:.2f}s-{high:.2f}s after the "
            "anchor) all landed after the report"
        )
        # Batches can run faster than the calibration one (a CI run had them a second faster,
        # past the whole callback window): aim before the report this batch actually had too.
        reported = report["reported_at"] - anchor_wall
        delay = max(0.0, min(low + (delay - low) / 2, reported - CALLBACK_WINDOW_S / 2))


def run_trials(
    shared: SharedStack,
    backend: str,
    kind: str,
    submit,
    seed_tag: str,
) -> None:
    stack = shared.stack
    assert stack is not None and shared.backend == backend, (shared.backend, backend)
    rng = random.Random(f"{SEED}:{seed_tag}")
    client = RolloutClient(stack.redis_url)
    trials: list[Trial] = []
    abandoned: list[str] = []  # batches whose kill came after their report
    try:
        if shared.windows is None:  # a new stack: time it (once for its three kinds)
            calibrate(client, submit)  # the first batch of a stack is slower (cold workers)
            shared.windows = calibrate(client, submit)
        windows = shared.windows
        for number in range(1, TRIALS + 1):
            # Trial i of kind j kills at a random moment of window i + j (cycling): with two
            # trials per kind, every phase is still hit twice per backend.
            window = windows[(number - 1 + KINDS.index(kind)) % len(windows)]
            trial = Trial(backend, kind, number, rng.uniform(window[1], window[2]))
            trials.append(trial)
            RESULTS.append(trial)
            try:
                submitted, replaced = kill_before_report(
                    stack, client, trial, submit, rng, window, trial.delay, abandoned
                )
                report = client.wait(trial.batch_id, timeout=REPORT_TIMEOUT_S)
                seen = time.monotonic()
                trial.recovery = seen - replaced
                trial.submit_to_report = seen - submitted
                trial.finalized_by = report.get("finalized_by", "")
                check_counted_once(client, report, COUNT)
                assert trial.recovery <= RECOVERY_LIMIT_S, (
                    f"the report came {trial.recovery:.1f}s after the replacement started"
                )
            except (AssertionError, TimeoutError, BatchTimeout) as exc:
                trial.problem = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            print(trial.line(), flush=True)
        # Every run is deleted in the end too (those of the abandoned batches included).
        for trial in trials:
            state = wait_cleanup(client, trial.batch_id) if trial.batch_id else "never submitted"
            if state == "deleted":
                trial.cleanup = state
                reported = (client.report(trial.batch_id) or {}).get("reported_at")
                trial.cleanup_seconds = time.time() - reported if reported else None
            else:
                trial.problem += f" cleanup still {state!r} after {CLEANUP_TIMEOUT_S:.0f}s"
        left = {b: state for b in abandoned if (state := wait_cleanup(client, b)) != "deleted"}
    finally:
        client.close()
    failed = [t for t in trials if t.problem]
    if failed or left:
        stack.keep_dir = True  # the workers' logs stay for the diagnosis
    assert not failed, f"logs in {stack.dir}:\n" + "\n".join(
        f"{t.line()}\n    {t.problem}" for t in failed
    )
    assert not left, f"runs of batches killed after their report not deleted: {left}"


def wait_cleanup(client: RolloutClient, batch_id: str) -> str:
    """The batch's cleanup state once it says `deleted`, or after CLEANUP_TIMEOUT_S."""
    start = time.monotonic()
    while (state := client.receipt(batch_id).get("cleanup")) != "deleted":
        if time.monotonic() - start > CLEANUP_TIMEOUT_S:
            return str(state)
        time.sleep(0.25)
    return state


# -- local backend ---------------------------------------------------------------------------
@pytest.fixture
def local_stack(request, shared_stack) -> Iterator[LocalStack]:
    keep = bool(os.environ.get("ROLLOUT_KILL_KEEP"))
    yield from stack_for(
        request, shared_stack, "local", lambda: LocalStack(collectors=2, keep_dir=keep)
    )


@pytest.mark.timeout(TRIALS_TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_local_batches_survive_killed_workers(local_stack, shared_stack, kind):
    def submit(client: RolloutClient) -> str:
        return client.submit(count=COUNT, parallelism=3).batch_id

    run_trials(shared_stack, "local", kind, submit, f"local:{kind}")


# -- Kubernetes (KWOK nodes) -----------------------------------------------------------------
@pytest.fixture
def kwok_stack(request, shared_stack, k8s_cluster, kwok_nodes) -> Iterator[LocalStack]:
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig)}
    keep = bool(os.environ.get("ROLLOUT_KILL_KEEP"))
    yield from stack_for(
        request,
        shared_stack,
        "kubernetes",
        lambda: LocalStack(collectors=2, extra_env=env, keep_dir=keep),
    )


ALL_SUCCEED = Mix(SEED, weights=((SUCCESS, 1),))


@pytest.mark.kwok
@pytest.mark.k8s
@pytest.mark.timeout(TRIALS_TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_kwok_batches_survive_killed_workers(
    kwok_stack, shared_stack, kwok_runtime, episodes, kind
):
    def submit(client: RolloutClient) -> str:
        batch_id = episodes.use_mix(new_batch_id(), ALL_SUCCEED)
        request = kwok_request(kwok_runtime, batch_id=batch_id, count=COUNT, parallelism=COUNT)
        return client.submit(**request).batch_id

    run_trials(shared_stack, "kubernetes", kind, submit, f"kwok:{kind}")
