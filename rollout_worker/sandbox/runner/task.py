"""The episode's identity and task: from the environment, the tasks file or a warm
sandbox's hand-over line; the hidden tests taken out of the agent's reach."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import selectors
import socket
import time
import typing

from .errors import InfrastructureError

# A file of the batch's tasks with their hidden tests, for a runner that grades in the
# container its agent acts in (Kubernetes, a task in its own image): read into memory and
# removed before any agent process exists (the tasks file holds the tasks without them).
HIDDEN_TASKS_ENV = "ROLLOUT_HIDDEN_TASKS_FILE"


# A warm sandbox's hidden tests, from its hand-over line (never written to a file).
HANDED_TESTS: dict = {}


def take_hidden_tests() -> dict:
    """{task id: tests}: handed over (a warm sandbox), or from HIDDEN_TASKS_ENV's file, which
    is gone when this returns (an InfrastructureError when it cannot be removed: the agent
    must never find it). The runner is not dumpable (harden), so the agent cannot read them
    from its memory either."""
    path = os.environ.get(HIDDEN_TASKS_ENV)
    if not path:
        return dict(HANDED_TESTS)
    tasks = _take_json(path, "the hidden tests")
    return {t["id"]: t["tests"] for t in tasks if isinstance(t, dict) and t.get("tests")}


def _take_json(path: str, what: str) -> typing.Any:
    """The JSON of `path`, the file gone when this returns (an InfrastructureError naming
    `what` when it cannot be read or removed: the agent must never find it)."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
        os.unlink(path)
    except (OSError, ValueError) as exc:
        raise InfrastructureError(f"{what} cannot be taken out of reach: {exc}") from None
    return value


# A folder holding the episode's steps in full (statements, tests, solutions), for a task
# with steps on the local backend: read into memory and removed before any agent process
# exists; the tasks file holds only the steps' names and limits (an earlier step's agent must
# not read a later step's tests, nor its statement).
HIDDEN_STEPS_ENV = "ROLLOUT_HIDDEN_STEPS_DIR"
HIDDEN_STEPS_FILE = "steps.json"
# Set by a backend that runs each step's agent and tests in containers of their own
# (multistep.py pod_part): this container's step, from 1; each container gets only its part.
STEP_ENV = "ROLLOUT_STEP"


def take_hidden_steps() -> dict:
    """{task id: steps} from HIDDEN_STEPS_ENV's folder ({} when not set), the file gone when
    this returns (an InfrastructureError when it cannot be removed)."""
    folder = os.environ.get(HIDDEN_STEPS_ENV)
    if not folder:
        return {}
    steps = _take_json(os.path.join(folder, HIDDEN_STEPS_FILE), "the steps")
    return steps if isinstance(steps, dict) else {}


def load_task(identity: dict, hidden: dict | None = None) -> dict:
    with open(os.environ["ROLLOUT_TASKS_FILE"]) as handle:
        tasks = json.load(handle)
    if isinstance(tasks, dict):
        tasks = tasks.get("tasks", [])
    for task in tasks:
        if task.get("id") == identity["task_id"]:
            tests = (hidden or {}).get(task["id"])
            task = dict(task, tests=tests) if tests else task
            if task.get("steps") and not os.environ.get(STEP_ENV):
                steps = take_hidden_steps().get(task["id"])
                if not isinstance(steps, list) or len(steps) != len(task["steps"]):
                    raise InfrastructureError("the task's steps were not handed over")
                task = dict(task, steps=steps)
            return task
    raise InfrastructureError(f"task {identity['task_id']!r} is not in the tasks file")


def episode_identity() -> dict:
    attempt = int(os.environ.get("ROLLOUT_ATTEMPT") or 0)
    if os.environ.get("ROLLOUT_TASK_ID"):
        return {
            "task_id": os.environ["ROLLOUT_TASK_ID"],
            "sample": int(os.environ.get("ROLLOUT_SAMPLE", "0")),
            "group_id": os.environ["ROLLOUT_GROUP_ID"],
            "attempt": attempt,
        }
    # An Indexed Job: the completion index says which task and sample (the batch's order).
    with open(os.environ["ROLLOUT_TASKS_FILE"]) as handle:
        tasks = json.load(handle)
    samples = int(os.environ.get("ROLLOUT_SAMPLES_PER_TASK", "1"))
    index = int(os.environ["JOB_COMPLETION_INDEX"]) + int(os.environ.get("ROLLOUT_INDEX_OFFSET", 0))
    position, sample = divmod(index, samples)
    task_id = tasks[position]["id"]
    return {
        "task_id": task_id,
        "sample": sample,
        "group_id": f"{os.environ['ROLLOUT_BATCH_ID']}:{task_id}",
        "attempt": attempt,
    }


def take_handover(stream: typing.TextIO) -> bool:
    """A warm sandbox (ROLLOUT_HANDOVER=stdin) was started before its episode existed: it
    waits here, interpreter and imports done, for the one line that makes it an episode
    (written through the API server's attach, so the sandbox's network stays closed). The line
    is JSON: `env` (the variables a cold sandbox gets from its Pod spec) and, for real rollouts,
    `tasks` (this episode's task as its agent may see it, written to ROLLOUT_TASKS_FILE) and
    `hidden_tests` (kept in memory: take_hidden_tests). False when stdin closed
    without a line (the pool was drained): there is no episode to run."""
    line = stream.readline()
    if not line.strip():
        return False
    apply_handover(json.loads(line))
    return True


def apply_handover(handover: dict) -> None:
    os.environ.update({str(k): str(v) for k, v in handover["env"].items()})
    if "tasks" in handover:
        with open(os.environ["ROLLOUT_TASKS_FILE"], "w") as handle:
            json.dump(handover["tasks"], handle)
    if isinstance(handover.get("hidden_tests"), dict):
        HANDED_TESTS.update(handover["hidden_tests"])


# Direct hand-over (the worker's kube/handover.py): besides stdin, a waiting Pod listens on
# this port for `token\n` + the same line, answered `ok\n`. Anything arriving there is hostile:
# a connection gets HANDOVER_READ_SECONDS and HANDOVER_MAX_BYTES, then is closed.
HANDOVER_PORT_ENV = "ROLLOUT_HANDOVER_PORT"
HANDOVER_TOKEN_ENV = "ROLLOUT_HANDOVER_TOKEN"
HANDOVER_READ_SECONDS = 5.0
HANDOVER_MAX_BYTES = 8 << 20
HANDOVER_ACK = b"ok\n"


def wait_for_handover(stdin: typing.TextIO) -> bool:
    """take_handover, or (with HANDOVER_PORT_ENV and HANDOVER_TOKEN_ENV set) the first of
    stdin and a connection on that port that brings the token and a good line. The token
    leaves the environment at once (the agent never sees it); the listener is closed before
    this returns, so nothing of the episode can inherit or reach it."""
    token = os.environ.pop(HANDOVER_TOKEN_ENV, "")
    port = os.environ.pop(HANDOVER_PORT_ENV, "")
    if not token or not port.isdigit():
        return take_handover(stdin)
    try:
        listener = socket.create_server(("", int(port)), backlog=8)
    except OSError:
        return take_handover(stdin)  # no port: the worker's connection fails, it attaches
    chosen = selectors.DefaultSelector()
    try:
        chosen.register(stdin, selectors.EVENT_READ)
        chosen.register(listener, selectors.EVENT_READ)
        while True:
            for ready, _ in chosen.select():
                if ready.fileobj is not listener:
                    return take_handover(stdin)
                if direct_handover(listener, token.encode()):
                    stdin_to_devnull(stdin)
                    return True
    finally:
        chosen.close()
        listener.close()


def direct_handover(listener: socket.socket, token: bytes) -> bool:
    """Take one connection: True once its line is applied and acknowledged; False (closed,
    the runner keeps waiting) on a wrong token, garbage, too long a line or too slow a peer."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return False
    with conn:
        try:
            handover = json.loads(read_handover(conn, token))
        except (OSError, ValueError):
            return False
        if not isinstance(handover, dict) or not isinstance(handover.get("env"), dict):
            return False
        apply_handover(handover)
        # Taken even if the ack is lost: the worker then finds the episode's first event.
        with contextlib.suppress(OSError):
            conn.sendall(HANDOVER_ACK)
    return True


def read_handover(conn: socket.socket, token: bytes) -> bytes:
    """The line of `token\nline\n`; ValueError on a wrong token (as soon as its line is in),
    or when it does not come whole within HANDOVER_READ_SECONDS and HANDOVER_MAX_BYTES."""
    deadline = time.monotonic() + HANDOVER_READ_SECONDS
    data = bytearray()
    newlines = 0
    given = b""
    while newlines < 2:
        left = deadline - time.monotonic()
        if left <= 0 or len(data) > HANDOVER_MAX_BYTES:
            raise ValueError("hand-over too slow or too long")
        conn.settimeout(left)
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ValueError("hand-over connection closed early")
        data += chunk
        if not newlines and b"\n" in chunk:
            given = bytes(data[: data.index(b"\n")])
        newlines += chunk.count(b"\n")
        if newlines and not hmac.compare_digest(given, token):
            raise ValueError("wrong hand-over token")
    _, line, rest = bytes(data).split(b"\n", 2)
    if rest or len(line) > HANDOVER_MAX_BYTES:
        raise ValueError("hand-over too long")
    return line


def stdin_to_devnull(stdin: typing.TextIO) -> None:
    """Handed over directly, stdin (no attach ever came) stays an open pipe nobody writes:
    /dev/null in its place gives the episode the end of input an attach's would (and a
    late attach's line goes nowhere: a runner takes one line)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, stdin.fileno())
    os.close(null)
