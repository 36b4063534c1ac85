"""One RL episode in a sandbox: prepare the task, let the agent act, test, report a reward.

Runs with any Python >= 3.9 and only the standard library (python:3.12-alpine has nothing
else), as an unprivileged user, in its own workspace. Its stdout carries the JSON events the
workers validate, one per line.

Modes:

- The guide's demo (neither ROLLOUT_POLICY nor ROLLOUT_TASKS_FILE): the built-in shipping task
  and a fixed action (ROLLOUT_ACTION fix | none | hang). Exactly two events, `ready` and
  `reward`; the exit status is 0 only when the tests pass after the action.
- The built-in agent loop (a task without `agent`; ready's mode "agent"): the episode's task
  comes from ROLLOUT_TASKS_FILE; the policy is asked for actions through the OpenAI-compatible
  chat completions API at `<policy>/rollout/<episode id>/v1/chat/completions`, every request
  carrying the episode's group id. Actions (write_file, read_file, run, submit) run here, in
  the workspace; their observations go back to the policy, until submit, the step limit or the
  time limit. Then the task's tests run and the reward rule applies (`all`: 1 when every test
  passes, else 0; `fraction`: passed / total). Events: `ready`, one `step` per policy turn
  (the turn's actions, each observation truncated to MAX_OBSERVATION_BYTES with
  TRUNCATION_MARKER, timings, and the server's whole response verbatim, token ids and
  log-probabilities included when it sends them, and the turn's `policy_version`), then
  `reward`; or an `error` event with a `kind` (`infrastructure`: the policy endpoint was
  unreachable, timed out or answered with something that is not a chat completion; `episode`:
  the task is broken) and no reward; or, with `max_policy_lag` set, a `stale` event
  (first_version, version, lag, max_policy_lag, steps) when the policy answering a turn is
  more than that many versions past the one that answered the first turn: the episode stops
  there, no tests, no reward. A turn's version is the `X-Policy-Version` response header, else
  the body's `weight_version` or `metadata.weight_version` (SGLang), else null; only integer
  versions are compared. Exit status: 0 with a reward (whatever its value), stale (a withdrawn
  episode, not a failure nor one to retry) or grade_pending, 3 for an episode error, 4 for an
  infrastructure error.
- An agent command (the task's `agent` is {command, env}; ready's mode "command"): no loop
  here. A recording proxy on 127.0.0.1 (the agent's OPENAI_BASE_URL) forwards each chat
  completion the agent asks for to the same per-episode policy endpoint, with the agent's own
  body (the batch's model; its sampling only where the agent set nothing), and logs each
  exchange as a `step` event: step, request (the body without its messages), new_messages
  (beyond the previous exchange's, or all of them with messages_reset), response (a stream's
  chunks assembled into one chat.completion; `stream`, `chunks`), status, error, timings,
  policy_version. The command runs in the workspace, in its own process group, until it exits
  or the task's time limit; then an `agent_exit` event (exit_code, null when killed at the
  limit; timed_out, seconds, output_tail, output_bytes). A policy lost for good (unreachable,
  5xx after the retries, no chat completion) stops the agent and ends the episode with an
  infrastructure error; a policy past max_policy_lag answers the agent 409, stops it, `stale`.
- The oracle (`agent` "oracle"; mode "oracle"): no policy; the task's `solution` is placed at
  /solution and `bash /solution/solve.sh` runs as the agent command.

Grading, every real mode: the task's `tests` are placed at /tests (only now: the agent never
sees them), /logs/verifier is emptied (for tests or the rule `file`), test_files written
again, test_command run; the reward rule `file` reads /logs/verifier/reward.json (a numeric
`reward`, or its only number; its other numbers become `reward_details`), else reward.txt (one
number). A directory that cannot be made is replaced by a temporary one; the tests (and the
oracle) find the directories used in ROLLOUT_TESTS_DIR, ROLLOUT_VERIFIER_DIR (and
ROLLOUT_SOLUTION_DIR). The same variables in the runner's own environment move them elsewhere
(a sandbox without a root of its own, tests). The baseline (the tests must fail before the
agent acts) runs unless the task says `baseline: false` or has `tests`. With `grade: fresh`
the agent's sandbox ends with a `grade_pending` event (the outcome's fields so far; exit 0)
and a second sandbox runs this program with ROLLOUT_PHASE=grade over a copy of the workspace:
`ready` (mode "grade"), then `reward`.

The cost ledger: the event that ends a sandbox's part of the episode (reward, grade_pending,
stale or error) carries `cost`, read just before it: cpu_seconds (user + system),
cpu_user_seconds, cpu_system_seconds, peak_memory_bytes and cpu_source (`cgroup`: the
container's cgroup files, with ROLLOUT_COST_SOURCE=cgroup; `proc`: the processes in /proc,
every one with ROLLOUT_COST_SOURCE=proc in a PID namespace of its own, else the runner's own
tree; peak memory then is the largest single process), policy_turns, prompt_tokens and
completion_tokens (the responses' `usage`; null when no answer had one), policy_seconds,
policy_retry_seconds (what failed attempts on the policy took: not counted against the task's
time limit, see `time_allowed`), and ledger_cpu_seconds (what the reading cost). Unknown
figures are null.

Environment: EPISODE_ID (the sandbox's name), ROLLOUT_WORKSPACE (default /workspace),
ROLLOUT_ACTION; for the agent runner ROLLOUT_POLICY (JSON: model, sampling,
request_timeout_seconds, max_retries, optionally max_policy_lag), ROLLOUT_POLICY_SOCKET (a
unix socket that forwards to the policy; the local backend) or ROLLOUT_POLICY_URL (the
policy's root URL; Kubernetes),
ROLLOUT_TASKS_FILE, and either ROLLOUT_TASK_ID / ROLLOUT_SAMPLE / ROLLOUT_GROUP_ID or
JOB_COMPLETION_INDEX (+ ROLLOUT_INDEX_OFFSET, the first episode of its Job) /
ROLLOUT_SAMPLES_PER_TASK / ROLLOUT_BATCH_ID to work them out;
ROLLOUT_ATTEMPT (0 for the first run of this episode, n for its n-th retry in a fresh sandbox
after an infrastructure failure), sent to the policy as X-Rollout-Attempt; ROLLOUT_PHASE
(`grade`: the second sandbox of a `grade: fresh` episode).
A warm sandbox (ROLLOUT_HANDOVER=stdin) gets the episode's variables on stdin instead (see
take_handover).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUGGY = "def shipping(total):\n    return 0 if total > 99 else 10\n"
TESTS = """import unittest

from shipping import shipping


class ShippingTest(unittest.TestCase):
    def test_below_threshold_pays_shipping(self):
        self.assertEqual(shipping(98), 10)

    def test_threshold_is_free(self):
        self.assertEqual(shipping(99), 0)

    def test_above_threshold_is_free(self):
        self.assertEqual(shipping(100), 0)


if __name__ == "__main__":
    unittest.main()
"""
TERMINATION_LOG = "/dev/termination-log"

# Observations (command output, file contents) longer than this are cut, and the marker says
# how much was left out. Test output in the reward event is cut the same way.
MAX_OBSERVATION_BYTES = 4096
TRUNCATION_MARKER = "\n[... {omitted} bytes truncated ...]"
# A server response larger than this is not copied into the step event (which the collectors
# refuse above 256 KiB); its size and digest are kept instead.
MAX_RESPONSE_BYTES = 192 * 1024
# Asked on every turn for the trainer's token view (rollout_wire/tokens.py): the server's own
# prompt and completion ids (vLLM, SGLang) and the sampled tokens' log-probabilities.
TOKEN_REQUEST = {"return_token_ids": True, "logprobs": True}
MAX_RESPONSE_READ = 8 * 2**20
COMMAND_TIMEOUT_SECONDS = 30
# A connection the policy endpoint has not accepted by then is retried on a new one rather than
# waited on for the whole request timeout (a dropped SYN costs seconds, not a minute; OpenAI's
# own client uses 5 s too).
CONNECT_TIMEOUT_SECONDS = 5.0
# A connection to the policy answered within this long is used again (a new TCP connection
# costs a round trip and the server a new thread: ~2 ms a call on a Pod network); older, it is
# closed, since servers close idle ones (uvicorn, under vLLM and SGLang, after 5 s).
KEEP_ALIVE_SECONDS = 2.0
TESTS_TIMEOUT_SECONDS = 60
GROUP_HEADER = "X-Rollout-Group-Id"
VERSION_HEADER = "X-Policy-Version"
# A version is a label, not a payload: a longer one is cut so events stay small.
MAX_VERSION_CHARS = 128
INTEGER = re.compile(r"-?[0-9]+")

EXIT_EPISODE_ERROR = 3
EXIT_INFRASTRUCTURE = 4

# Agent commands and grading.
ORACLE = "oracle"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
VERIFIER_DIR = "/logs/verifier"
# In VERIFIER_DIR, the first that exists is read (as rollout_wire.request.REWARD_FILES says).
REWARD_FILE_NAMES = ("reward.json", "reward.txt")
API_KEY = "rollout"  # the agent's OPENAI_API_KEY: clients insist on one, the proxy ignores it
KILL_GRACE_SECONDS = 2.0
OUTPUT_TAIL_LINES = 20
OUTPUT_TAIL_BYTES = 4096
MAX_ERROR_BODY = 2048
MAX_TESTS_OUTPUT = 8 * 2**20
# The collectors refuse an event above 256 KiB: a step event is fitted below this.
MAX_STEP_EVENT_BYTES = 240 * 1024
MAX_MESSAGE_TEXT = 16 * 1024
MAX_AGENT_REQUEST = 32 * 2**20
# Linux refuses an environment variable above 128 KiB; the whole statement is in its file.
MAX_ENV_STATEMENT = 64 * 1024
STREAM_READ = 65536

SYSTEM_PROMPT = (
    "You are a software engineer working in a small Python repository. Use the tools to look "
    "at files, change them and run commands; call submit when the task is done. Every tool "
    "result is shown to you. Long outputs are truncated."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or replace a file of the repository with the given text.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Show a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the repository; shows exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish: the tests run and decide the reward.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


# The proxy's threads and the main thread print events: one line at a time.
_EMIT_LOCK = threading.Lock()


def finite(value: object) -> object:
    """`value` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def emit(event: str, **data: object) -> dict[str, object]:
    record = {"event": event, "at": time.time(), "episode_id": os.environ["EPISODE_ID"]}
    record.update(data)
    if event in FINAL_EVENTS:
        # Measured last, so the reading covers all the sandbox did (its tests included).
        record["cost"] = LEDGER.measure()
    try:
        line = json.dumps(record, allow_nan=False)
    except ValueError:
        # A server's or agent's NaN (say, a log-probability) would make the line no JSON.
        line = json.dumps(finite(record))
    with _EMIT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    if event == "ready" and os.environ.get("ROLLOUT_READY_FILE"):
        mark_ready(os.environ["ROLLOUT_READY_FILE"])
    return record


def mark_ready(path: str) -> None:
    # Kubernetes: the Pod's startup probe looks for this file, so the Pod status (which the
    # workers already watch) says the episode is ready without anyone reading its log.
    try:
        with open(path, "w"):
            pass
    except OSError:
        pass  # progress only: the event in the log is what validation reads


def truncate(text: str, limit: int = MAX_OBSERVATION_BYTES) -> tuple[str, bool]:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text, False
    kept = data[:limit].decode("utf-8", "ignore")
    return kept + TRUNCATION_MARKER.format(omitted=len(data) - limit), True


def record_outcome(event: dict[str, object]) -> None:
    # Kubernetes carries this file back in the Pod status: the outcome (a reward, or an error's
    # kind and cause) survives even if the log stream is cut or never read.
    if os.path.exists(TERMINATION_LOG):
        keys: tuple = ("at", "episode_id", "reward", "baseline_exit", "tests_exit")
        if event.get("event") == "error":
            keys = ("at", "episode_id", "kind", "cause")
        elif event.get("event") == "stale":
            keys = ("at", "episode_id", "first_version", "version", "lag", "max_policy_lag")
        elif event.get("event") == "grade_pending":
            keys = ("at", "episode_id")
        summary = {k: event.get(k) for k in keys}
        if event.get("event") in ("error", "stale", "grade_pending"):
            summary[str(event["event"])] = True
        try:
            with open(TERMINATION_LOG, "w") as handle:
                handle.write(json.dumps(summary))
        except OSError:
            pass


# -- the cost ledger ---------------------------------------------------------------------------
# Where the CPU and memory figures come from, set by the backend: "cgroup" (Kubernetes: the
# container's own cgroup holds every process of the sandbox), "proc" (a PID namespace of its
# own, the local bubblewrap sandbox: every process in /proc is the sandbox's). Unset: the
# runner's own process tree (a runner with no namespace of its own must not count the host's).
COST_SOURCE_ENV = "ROLLOUT_COST_SOURCE"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_ROOT = "/proc"
# The events that end a sandbox's part of the episode: each carries the ledger.
FINAL_EVENTS = ("reward", "grade_pending", "stale", "error")


def _read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read(65536)
    except (OSError, UnicodeDecodeError):
        return None


def _keyed_numbers(text: str | None) -> dict:
    """`name value` lines (cpu.stat, cpuacct.stat) as {name: int}."""
    found: dict = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            found[parts[0]] = int(parts[1])
    return found


def _first_number(root: str, names: tuple) -> int | None:
    for name in names:
        text = _read_text(os.path.join(root, name))
        if text is not None and text.strip().isdigit():
            return int(text.strip())
    return None


def read_cgroup(root: str = CGROUP_ROOT, ticks: float | None = None) -> dict:
    """CPU and peak memory of the cgroup at `root`: cgroup v2 (cpu.stat, memory.peak), else
    v1 (cpuacct.usage and cpuacct.stat, memory.max_usage_in_bytes); None for what is not
    there."""
    cost: dict = {
        "cpu_seconds": None,
        "cpu_user_seconds": None,
        "cpu_system_seconds": None,
        "peak_memory_bytes": None,
        "cpu_source": "cgroup",
    }
    v2 = _keyed_numbers(_read_text(os.path.join(root, "cpu.stat")))
    if "usage_usec" in v2:
        cost["cpu_seconds"] = v2["usage_usec"] / 1e6
        if "user_usec" in v2 and "system_usec" in v2:
            cost["cpu_user_seconds"] = v2["user_usec"] / 1e6
            cost["cpu_system_seconds"] = v2["system_usec"] / 1e6
    else:
        for folder in ("cpuacct", "cpu,cpuacct", "cpu"):
            base = os.path.join(root, folder)
            usage = _first_number(base, ("cpuacct.usage",))  # nanoseconds
            split = _keyed_numbers(_read_text(os.path.join(base, "cpuacct.stat")))  # ticks
            if usage is None and not split:
                continue
            hz = ticks or os.sysconf("SC_CLK_TCK")
            if "user" in split and "system" in split:
                cost["cpu_user_seconds"] = split["user"] / hz
                cost["cpu_system_seconds"] = split["system"] / hz
            if usage is not None:
                cost["cpu_seconds"] = usage / 1e9
            elif cost["cpu_user_seconds"] is not None:
                cost["cpu_seconds"] = (split["user"] + split["system"]) / hz
            break
    cost["peak_memory_bytes"] = _first_number(
        root,
        ("memory.peak", "memory.max_usage_in_bytes", "memory/memory.max_usage_in_bytes"),
    )
    return cost


def read_proc(root: str = PROC_ROOT, scope: int | None = None, ticks: float | None = None) -> dict:
    """CPU and peak memory of the processes in `root` (every one, or `scope` and the processes
    below it), in one pass. A process's CPU is its utime + stime plus cutime + cstime: a child
    that was waited for is in its reaper's, so the live processes account for every process
    that ever ran below them (an orphan's time is in whoever reaped it: the runner, a
    subreaper, or the namespace's init). Peak memory is the largest VmHWM: the largest single
    process, not a sum. CPU fields None when `root` (or the scope's process) is unreadable."""
    cost: dict = {
        "cpu_seconds": None,
        "cpu_user_seconds": None,
        "cpu_system_seconds": None,
        "peak_memory_bytes": None,
        "cpu_source": "proc",
    }
    try:
        entries = os.listdir(root)
    except OSError:
        return cost
    stats: dict = {}  # pid -> (parent, user ticks, system ticks)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(root, entry, "stat"), "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            # After the command: state, ppid, ... utime (14), stime, cutime, cstime (17).
            stats[int(entry)] = (
                int(fields[1]),
                int(fields[11]) + int(fields[13]),
                int(fields[12]) + int(fields[14]),
            )
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not a process's stat
    if scope is None:
        chosen = list(stats)
    elif scope in stats:
        children: dict = {}
        for pid, (parent, _, _) in stats.items():
            children.setdefault(parent, []).append(pid)
        chosen, todo = [scope], [scope]
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in chosen:
                    chosen.append(child)
                    todo.append(child)
    else:
        chosen = []
    if not chosen:
        return cost
    hz = ticks or os.sysconf("SC_CLK_TCK")
    user = sum(stats[pid][1] for pid in chosen) / hz
    system = sum(stats[pid][2] for pid in chosen) / hz
    cost.update(cpu_seconds=user + system, cpu_user_seconds=user, cpu_system_seconds=system)
    peaks = []
    for pid in chosen:
        for line in (_read_text(os.path.join(root, str(pid), "status")) or "").splitlines():
            if line.startswith("VmHWM:"):
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    peaks.append(int(parts[1]) * 1024)  # kB
                break
    cost["peak_memory_bytes"] = max(peaks) if peaks else None
    return cost


def read_usage(
    source: str | None, cgroup_root: str = CGROUP_ROOT, proc_root: str = PROC_ROOT
) -> dict:
    """The sandbox's CPU and peak memory as `source` (ROLLOUT_COST_SOURCE) says to read them."""
    if source == "cgroup":
        cost = read_cgroup(cgroup_root)
        if cost["cpu_seconds"] is not None:
            return cost
    # Kubernetes without readable cgroup files: the container's PID namespace is its own too.
    everything = source in ("cgroup", "proc")
    cost = read_proc(proc_root, scope=None if everything else os.getpid())
    # Also the largest child the runner waited for (kilobytes on Linux): one that ended before
    # the reading has no VmHWM left to read. Still the largest single process, not a sum.
    peaks = [cost["peak_memory_bytes"] or 0]
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        with contextlib.suppress(OSError, ValueError):
            peaks.append(resource.getrusage(who).ru_maxrss * 1024)
    cost["peak_memory_bytes"] = max(peaks) or None
    return cost


def _count(usage: object, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return int(value)


class Ledger:
    """What the episode asked of its policy: turns (every completion asked for), tokens (the
    responses' `usage`; a stream's comes in its last chunk), seconds waited. Counted where the
    answers arrive: the built-in loop's client and the recording proxy's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.turns = 0
        self.with_usage = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.policy_seconds = 0.0
        self.retry_seconds = 0.0
        self.requests = 0

    def sent(self) -> None:
        """One request sent to the policy (every attempt): the host's policy socket counts
        the completions it answered, and more answers than requests were never recorded."""
        with self.lock:
            self.requests += 1

    def retried(self, seconds: float) -> None:
        """`seconds` spent on failed attempts on the policy (and the waits between them)."""
        with self.lock:
            self.retry_seconds += max(0.0, seconds)

    def turn(self, response: object, seconds: float) -> None:
        """One completion asked for: `response` the parsed answer (None when there is none),
        `seconds` the wall time spent waiting on it."""
        usage = response.get("usage") if isinstance(response, dict) else None
        prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
        with self.lock:
            self.turns += 1
            self.policy_seconds += max(0.0, seconds)
            if prompt is not None or completion is not None:
                self.with_usage += 1
                self.prompt_tokens += prompt or 0
                self.completion_tokens += completion or 0

    def measure(self) -> dict:
        """The `cost` object of a final event: one reading of the sandbox's CPU and memory,
        and the policy's figures so far."""
        began = time.thread_time()  # this thread's reading alone
        cost = read_usage(os.environ.get(COST_SOURCE_ENV))
        with self.lock:
            # Turns whose answers all lacked `usage`: their tokens are unknown, not zero.
            unknown = self.turns > 0 and self.with_usage == 0
            cost.update(
                policy_turns=self.turns,
                prompt_tokens=None if unknown else self.prompt_tokens,
                completion_tokens=None if unknown else self.completion_tokens,
                policy_seconds=self.policy_seconds,
                policy_retry_seconds=self.retry_seconds,
                policy_requests=self.requests,
            )
        cost["ledger_cpu_seconds"] = time.thread_time() - began
        return cost


# One episode per runner process: its one ledger.
LEDGER = Ledger()


def time_allowed(time_limit: float) -> float:
    """The agent's time: its limit plus what failed attempts on the policy took, up to one
    more limit. A policy endpoint that stalls is infrastructure; its stall must not eat the
    agent's time and come back as a reward."""
    return time_limit + min(LEDGER.retry_seconds, time_limit)


def check_time_limit(time_limit: float) -> None:
    """Called when the time limit stopped the agent: InfrastructureError when failed policy
    attempts took more than the extension covers (the agent had less than its time)."""
    lost = LEDGER.retry_seconds
    if lost > time_limit:
        raise InfrastructureError(
            f"failed attempts on the policy took {lost:.1f}s of the agent's time, more than "
            f"its time limit ({time_limit:g}s) allows for: the agent did not get its time"
        )


# -- the guide's demo --------------------------------------------------------------------------
def run_demo_tests() -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-B", "test_shipping.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout


def act(action: str) -> None:
    """The guide's stand-in for the agent's action."""
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "fix":
        with open("shipping.py") as handle:
            source = handle.read()
        with open("shipping.py", "w") as handle:
            handle.write(source.replace("total > 99", "total >= 99"))


def demo(action: str) -> int:
    with open("shipping.py", "w") as handle:
        handle.write(BUGGY)
    with open("test_shipping.py", "w") as handle:
        handle.write(TESTS)
    emit("ready")
    baseline_exit, _ = run_demo_tests()
    # Nothing but events goes to stdout or stderr: a Pod's log merges the two, and any other
    # line there is a protocol violation (validation fails the episode for it).
    if baseline_exit == 0:
        emit("error", kind="episode", cause="baseline tests passed; the task must start failing")
        return 3
    act(action)
    tests_exit, tests_output = run_demo_tests()
    reward = emit(
        "reward",
        reward=int(tests_exit == 0),
        baseline_exit=baseline_exit,
        tests_exit=tests_exit,
        tests_output=tests_output,
    )
    record_outcome(reward)
    return 0 if tests_exit == 0 else 1  # the reward event says why


# -- the agent runner --------------------------------------------------------------------------
class InfrastructureError(Exception):
    """The policy could not be used: not the episode's fault, never a reward."""


class ConnectTimeout(OSError):
    """The policy endpoint accepted no connection within CONNECT_TIMEOUT_SECONDS."""


class EpisodeError(Exception):
    """The task (or its agent) is broken: no sample of the policy, not worth a retry."""


class ResponseTooLarge(Exception):
    """The policy generated more than a turn may hold, under the batch's own settings: the
    episode's doing (its loop ends and the tests grade it), never an infrastructure failure."""


class StalePolicy(Exception):
    """The policy moved on past the episode's staleness bound: the episode stops, unscored."""

    def __init__(self, first: str, version: str, lag: int, max_lag: int, steps: int) -> None:
        super().__init__(f"policy at version {version}, first turn at {first}")
        self.fields = {
            "first_version": first,
            "version": version,
            "lag": lag,
            "max_policy_lag": max_lag,
            "steps": steps,
        }


def policy_version(header: object, response: object) -> str | None:
    """The version that answered a turn: the response header, else the body's
    `weight_version` (top level, or in `metadata` as SGLang sends it); None if none says."""
    candidates = [header]
    if isinstance(response, dict):
        candidates.append(response.get("weight_version"))
        metadata = response.get("metadata")
        if isinstance(metadata, dict):
            candidates.append(metadata.get("weight_version"))
    for value in candidates:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            continue
        text = str(value).strip()
        if text:
            return text[:MAX_VERSION_CHARS]
    return None


def version_lag(first: str | None, current: str | None) -> int | None:
    """current - first when both are integers; None otherwise (labels are never compared)."""
    if first is None or current is None:
        return None
    if not (INTEGER.fullmatch(first) and INTEGER.fullmatch(current)):
        return None
    return int(current) - int(first)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the unix socket the local backend bind-mounts into the sandbox."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("policy", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


class Policy:
    """Chat completions at `<root>/rollout/<episode id>/v1`, with the group id on every call."""

    def __init__(self, config: dict, episode_id: str, identity: dict) -> None:
        self.model = config.get("model", "policy")
        self.sampling = dict(config.get("sampling") or {})
        self.timeout = float(config.get("request_timeout_seconds", 60))
        self.retries = int(config.get("max_retries", 2))
        lag = config.get("max_policy_lag")
        self.max_policy_lag = lag if isinstance(lag, int) and not isinstance(lag, bool) else None
        # What every turn asks for on the trainer's behalf (its token view), unless the batch
        # said `tokens: false`.
        self.token_request = TOKEN_REQUEST if config.get("tokens", True) is not False else {}
        self.socket_path = os.environ.get("ROLLOUT_POLICY_SOCKET")
        self.kept: tuple | None = None  # (connection, when its last answer was read)
        self.kept_lock = threading.Lock()
        root = os.environ.get("ROLLOUT_POLICY_URL", "http://policy")
        parsed = urllib.parse.urlsplit(root)
        self.scheme, self.netloc = parsed.scheme, parsed.netloc
        prefix = parsed.path.rstrip("/")
        self.path = f"{prefix}/rollout/{urllib.parse.quote(episode_id)}/v1/chat/completions"
        self.base_url = f"{root.rstrip('/')}/rollout/{episode_id}/v1"
        self.headers = {
            "Content-Type": "application/json",
            GROUP_HEADER: identity["group_id"],
            "X-Rollout-Task-Id": identity["task_id"],
            "X-Rollout-Sample": str(identity["sample"]),
            "X-Rollout-Episode-Id": episode_id,
            "X-Rollout-Attempt": str(identity.get("attempt", 0)),
        }

    def connect(self) -> http.client.HTTPConnection:
        """A connection to the endpoint, made within CONNECT_TIMEOUT_SECONDS; its reads then
        wait up to the request timeout."""
        timeout = min(CONNECT_TIMEOUT_SECONDS, self.timeout)
        conn: http.client.HTTPConnection
        if self.socket_path:
            conn = UnixHTTPConnection(self.socket_path, timeout)
        elif self.scheme == "https":
            conn = http.client.HTTPSConnection(self.netloc, timeout=timeout)
        else:
            conn = http.client.HTTPConnection(self.netloc, timeout=timeout)
        try:
            conn.connect()
        except socket.timeout:  # noqa: UP041 (Python 3.9: not yet TimeoutError)
            conn.close()
            raise ConnectTimeout(f"no connection within {timeout:g}s") from None
        except BaseException:
            conn.close()
            raise
        assert conn.sock is not None
        conn.sock.settimeout(self.timeout)
        if not self.socket_path:
            # http.client writes a request's headers and body apart (see ProxyHandler).
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def reuse(self) -> http.client.HTTPConnection:
        """The kept connection if it is fresh enough, else a new one (one at a time: the
        recording proxy's threads may ask at once)."""
        with self.kept_lock:
            kept, self.kept = self.kept, None
        if kept is not None:
            if time.monotonic() - kept[1] < KEEP_ALIVE_SECONDS:
                return kept[0]
            kept[0].close()
        return self.connect()

    def keep(self, conn: http.client.HTTPConnection, response: typing.Any) -> None:
        """Keep a connection whose answer was read whole, unless the server closes it."""
        if response.will_close:
            conn.close()
            return
        with self.kept_lock:
            old, self.kept = self.kept, (conn, time.monotonic())
        if old is not None:
            old[0].close()

    def send(self, payload: bytes, keep_open: bool = False) -> Answer:
        """POST a chat completions body. Retries connection failures, timeouts, 429 and 5xx;
        returns the first other answer, or the last 429/5xx; raises InfrastructureError when
        the endpoint never answered. With `keep_open`, an event stream is returned unread."""
        problem = ""
        began = time.time()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
                LEDGER.retried(time.time() - began)
                began = time.time()
            try:
                # A stream is read by the caller, then closed: never kept.
                conn = self.connect() if keep_open else self.reuse()
            except OSError as exc:
                problem = f"policy endpoint unreachable: {type(exc).__name__}: {exc}"
                continue
            try:
                LEDGER.sent()
                conn.request("POST", self.path, body=payload, headers=self.headers)
                response = conn.getresponse()
                status = response.status
                header = response.getheader(VERSION_HEADER)
                kind = response.getheader("Content-Type") or ""
                if keep_open and status == 200 and "text/event-stream" in kind:
                    return Answer(status, b"", header, attempt + 1, kind, conn, response)
                raw = response.read(MAX_RESPONSE_READ + 1)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                failed = "timed out" if isinstance(exc, socket.timeout) else "unreachable"
                problem = f"policy endpoint {failed}: {type(exc).__name__}: {exc}"
                continue
            if len(raw) <= MAX_RESPONSE_READ:
                self.keep(conn, response)
            else:
                conn.close()
            if (status == 429 or status >= 500) and attempt < self.retries:
                problem = f"policy endpoint answered HTTP {status}: {raw[:200]!r}"
                continue
            return Answer(status, raw, header, attempt + 1, kind)
        LEDGER.retried(time.time() - began)
        raise InfrastructureError(f"{problem} (after {self.retries + 1} attempt(s))")

    def tokens_of(self, response: dict, previous: list) -> tuple[dict, list, dict]:
        """turn_tokens, or why there are none when the batch asked for no ids."""
        if not self.token_request:
            return {"unavailable": "the batch asked for no token ids (tokens: false)"}, [], response
        return turn_tokens(response, previous)

    def complete(self, messages: list) -> tuple[dict, bytes, int, str | None]:
        """(parsed response, raw bytes, attempts, X-Policy-Version header or None). Raises
        InfrastructureError when the retries are spent or the answer is no chat completion."""
        body = dict(self.sampling)
        body.update(self.token_request)
        body.update({"model": self.model, "messages": messages, "tools": TOOLS})
        answer = self.send(json.dumps(body).encode())
        status, raw = answer.status, answer.raw
        if status == 429 or status >= 500:
            raise InfrastructureError(
                f"policy endpoint answered HTTP {status}: {raw[:200]!r} "
                f"(after {answer.attempts} attempt(s))"
            )
        if status != 200:
            raise InfrastructureError(
                f"policy endpoint refused the request: HTTP {status}: {raw[:200]!r}"
            )
        if len(raw) > MAX_RESPONSE_READ:
            raise ResponseTooLarge(f"policy response exceeds {MAX_RESPONSE_READ} bytes")
        try:
            parsed = json.loads(raw)
            message = parsed["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError("message is not an object")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise InfrastructureError(
                f"policy endpoint sent no chat completion ({exc}): {raw[:200]!r}"
            ) from None
        return parsed, raw, answer.attempts, answer.header


class Answer:
    """What the policy endpoint said: its status, body (none yet for a stream left open, which
    `conn` and `response` still read), version header, content type, and the attempts taken."""

    def __init__(
        self,
        status: int,
        raw: bytes,
        header: str | None,
        attempts: int,
        content_type: str,
        conn: http.client.HTTPConnection | None = None,
        response: http.client.HTTPResponse | None = None,
    ) -> None:
        self.status = status
        self.raw = raw
        self.header = header
        self.attempts = attempts
        self.content_type = content_type
        self.conn = conn
        self.response = response


def workspace_path(root: str, path: object) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        raise ValueError(f"path must be a relative path in the repository, got {path!r}")
    full = os.path.realpath(os.path.join(root, path))
    if full != root and not full.startswith(root + os.sep):
        raise ValueError(f"path {path!r} leaves the repository")
    return full


def _writable_dir(path: str) -> None:
    """`path` a real directory the runner can write (an agent may have left a link, a file or
    a read-only directory there)."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    if not os.path.isdir(path):
        os.mkdir(path)
    elif not os.access(path, os.W_OK | os.X_OK):
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | stat.S_IRWXU)


def write_files(root: str, files: dict, scripts: bool = False) -> None:
    """Write `files` (relative path -> text) under `root`. Whatever is in the way is removed,
    so each text lands where it is named and never through a link out of `root`. With
    `scripts`, a text starting with #! is made executable (texts carry no file modes)."""
    for path, text in files.items():
        parts = path.split("/") if isinstance(path, str) and "\0" not in path else []
        if not parts or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"path must be a relative path in the repository, got {path!r}")
        current = root
        for part in parts[:-1]:
            current = os.path.join(current, part)
            _writable_dir(current)
        full = os.path.join(current, parts[-1])
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        elif os.path.lexists(full):
            os.unlink(full)
        with open(full, "w") as handle:
            handle.write(text)
        if scripts and text.startswith("#!"):
            os.chmod(full, 0o755)


def empty_folder(path: str) -> None:
    """Remove everything in the folder `path` (never following a link), making writable on
    the way what the agent made unwritable; OSError when something stays."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            for folder, dirs, _ in os.walk(full):
                for name in [".", *dirs]:
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
            shutil.rmtree(full)
        else:
            os.unlink(full)


def fresh_dir(path: str, prefix: str) -> str:
    """`path` emptied (made when missing), or a new temporary directory when it cannot be:
    nothing an agent left there (a planted reward file, a link) reaches the grading."""
    try:
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
        empty_folder(path)
        if os.access(path, os.W_OK | os.X_OK) and not os.listdir(path):
            return path
    except OSError:
        pass
    return tempfile.mkdtemp(prefix=prefix)


def remove_special_files(root: str) -> None:
    """FIFOs, sockets and devices under `root` removed (a test that opens a FIFO would hang):
    a `fresh` grader receives files, folders and links, as a local copy does."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                    os.unlink(path)


def resolve_argv(argv: list, path: str) -> list:
    """argv with its program found: `python`/`python3` is this interpreter, a bare name is
    looked up on `path` (`bash` falls back to `sh`: alpine images have no bash)."""
    first = argv[0]
    if first in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if "/" in first:
        return list(argv)
    found = shutil.which(first, path=path)
    if found is None and first == "bash":
        found = shutil.which("sh", path=path)
    if found is None:
        raise EpisodeError(f"{first!r} is not on the sandbox's PATH ({path})")
    return [found, *argv[1:]]


def run_process(
    argv: list, env: dict, cwd: str, timeout: float, pass_fds: tuple = ()
) -> tuple[int, str, set]:
    """(exit code, output, the processes still running when it ended) of a command in its own
    process group, output to a file: a grandchild that keeps running (a test's server) neither
    holds a pipe open nor survives."""
    handle, output_path = tempfile.mkstemp(prefix="rollout-run-", suffix=".log")
    try:
        try:
            process = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        except OSError as exc:
            raise EpisodeError(f"{argv[0]!r} could not start: {exc}") from None
        finally:
            os.close(handle)
        try:
            code: int | None = process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        # What the command left running is killed here, by us: it did not end by itself.
        alive = set(descendants(os.getpid()))
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        if code is None:
            process.kill()
            process.wait()
        with open(output_path, "rb") as out:
            output = out.read(MAX_TESTS_OUTPUT).decode("utf-8", "replace")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(output_path)
    if code is None:
        return 124, output + f"\n[tests timed out after {timeout:.0f}s]", alive
    return code, output, alive


def run_command(command: str, timeout: float, env: dict) -> tuple[int, str]:
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=max(timeout, 1.0),
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.output.decode("utf-8", "replace") if exc.output else ""
        return 124, output + f"\n[command timed out after {timeout:.0f}s]"
    return done.returncode, done.stdout.decode("utf-8", "replace")


# -- the test harness: what ran, told where the code under test cannot print -------------------
# Test commands the grader can count: `python [flags] -m unittest|pytest ...` and
# `python [flags] script.py ...` (a script that calls unittest.main()). They run through the
# harness (its part of this file, run alone: `harness_source`), which reports what ran on a
# pipe only the runner reads, each record carrying a key the runner handed over on another
# pipe (read and closed before any test code is imported). Anything else (a task's own shell
# script) is graded by its exit status or its reward file, and the row says so (`graded_by`).
# Interpreter options a test command may carry; the harness passes them on.
PYTHON_FLAGS = {"-B", "-b", "-bb", "-u", "-O", "-OO", "-q", "-s", "-E"}
PYTHON_OPTIONS = {"-W", "-X"}  # each followed by a value
MAX_HARNESS_RECORD = 64 * 1024
# Why a reward is below full (the row's grade_cause); None when the tests earned it all.
CAUSE_FAILED = "tests_failed"
CAUSE_MISSING = "tests_missing"  # fewer tests ran than the task promises, or none
CAUSE_EXITED = "runner_exited"  # the test run ended before it reported its end
CAUSE_TIMED_OUT = "tests_timed_out"
CAUSE_TAMPERED = "tests_tampered"  # the code under test replaced unittest's own machinery
CAUSE_EXIT_STATUS = "exit_status"  # the tests said pass but the command exited non-zero
CAUSE_NO_REWARD_FILE = "no_reward_file"
CAUSE_BAD_REWARD_FILE = "reward_file_invalid"
CAUSE_REWARD_FILE = "reward_file"  # the tests wrote a reward below 1
GRADED_BY_RESULTS = "test_results"
GRADED_BY_EXIT = "exit_status"
GRADED_BY_FILE = "reward_file"


def harness_plan(argv: list) -> tuple[list, str, list] | None:
    """(interpreter flags, what runs: "unittest" | "pytest" | a script path, its arguments) of
    a countable test command; None for any other."""
    if not argv or argv[0] not in ("python", "python3"):
        return None
    flags: list = []
    rest = list(argv[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        flag = rest.pop(0)
        if flag in PYTHON_OPTIONS and rest:
            flags += [flag, rest.pop(0)]
        elif flag in PYTHON_FLAGS:
            flags.append(flag)
        else:
            return None
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in ("unittest", "pytest"):
        return flags, rest[1], rest[2:]
    if rest and rest[0].endswith(".py"):
        return flags, rest[0], rest[1:]
    return None


# -- harness: begin. The harness's whole source (json, os and sys its only imports; typing
# appears in annotations alone, never evaluated):
# the runner writes this part alone to a file and runs it, so a test run starts about as fast
# as the bare command (this whole program would add its compile and imports: `harness_source`).
HARNESS_KEY_BYTES = 16


def _fingerprint(classes: list) -> dict:
    """Each class's own attributes, by identity."""
    return {
        f"{c.__module__}.{c.__qualname__}.{name}": id(value)
        for c in classes
        for name, value in list(vars(c).items())
    }


def _tampering(classes: list, before: dict) -> list:
    """The attributes of `classes` replaced, added or removed since `before` (sorted)."""
    now = _fingerprint(classes)
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))


def _unittest_recorder(report: typing.Callable[[dict], None]) -> type:
    """A TextTestRunner that reports each test's verdict (by test id) when its run ends, and
    which of unittest's own machinery the code under test replaced (an assertion made a no-op,
    TestCase.run or the result's methods rewritten so every test "passes"): checked after
    every test and at the end, against what it was before any test module was imported."""
    import unittest
    import unittest.case

    class Result(unittest.TextTestResult):
        def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
            super().__init__(*args, **kwargs)
            self.verdicts: dict = {}
            self.tampered: set = set()

        def _mark(self, test: typing.Any, verdict: str) -> None:
            self.tampered.update(_tampering(watched, before))
            key = test.id()
            if self.verdicts.get(key) != "failed":  # a failed subtest fails its test for good
                self.verdicts[key] = verdict

        def addSuccess(self, test: typing.Any) -> None:
            super().addSuccess(test)
            self._mark(test, "passed")

        def addExpectedFailure(self, test: typing.Any, err: typing.Any) -> None:
            super().addExpectedFailure(test, err)
            self._mark(test, "passed")

        def addFailure(self, test: typing.Any, err: typing.Any) -> None:
            super().addFailure(test, err)
            self._mark(test, "failed")

        def addError(self, test: typing.Any, err: typing.Any) -> None:
            super().addError(test, err)
            self._mark(test, "failed")

        def addUnexpectedSuccess(self, test: typing.Any) -> None:
            super().addUnexpectedSuccess(test)
            self._mark(test, "failed")

        def addSkip(self, test: typing.Any, reason: str) -> None:
            super().addSkip(test, reason)
            self._mark(test, "skipped")

        def addSubTest(self, test: typing.Any, subtest: typing.Any, err: typing.Any) -> None:
            super().addSubTest(test, subtest, err)
            if err is not None:
                self.verdicts[test.id()] = "failed"

    class Runner(unittest.TextTestRunner):
        resultclass = Result

        def run(self, test: typing.Any) -> typing.Any:
            collected = test.countTestCases()
            result = super().run(test)
            verdicts = list(result.verdicts.values())  # type: ignore[attr-defined]
            tampered = result.tampered | set(_tampering(watched, before))  # type: ignore[attr-defined]
            report(
                {
                    "collected": collected,
                    "passed": verdicts.count("passed"),
                    "failed": verdicts.count("failed"),
                    "skipped": verdicts.count("skipped"),
                    "tampered": sorted(tampered)[:20],
                }
            )
            return result

    watched = [
        unittest.TestCase,
        unittest.case._Outcome,  # type: ignore[attr-defined]
        unittest.TestResult,
        unittest.TextTestResult,
        unittest.TextTestRunner,
        unittest.TestSuite,
        unittest.suite.BaseTestSuite,
        unittest.TestLoader,
        unittest.TestProgram,
        Result,
        Runner,
    ]
    before = _fingerprint(watched)
    return Runner


def _pytest_recorder(report: typing.Callable[[dict], None]) -> object:
    """A pytest plugin object: what was collected, and each test's verdict (by node id)."""

    class Recorder:
        def __init__(self) -> None:
            self.collected = 0
            self.verdicts: dict = {}

        def pytest_collection_finish(self, session: typing.Any) -> None:
            self.collected = len(session.items)

        def pytest_runtest_logreport(self, report: typing.Any) -> None:
            key = report.nodeid
            if report.failed:
                self.verdicts[key] = "failed"
            elif report.skipped and self.verdicts.get(key) != "failed":
                self.verdicts[key] = "skipped"
            elif report.when == "call" and key not in self.verdicts:
                self.verdicts[key] = "passed"

        def pytest_sessionfinish(self, session: typing.Any) -> None:
            verdicts = list(self.verdicts.values())
            report(
                {
                    "collected": self.collected,
                    "passed": verdicts.count("passed"),
                    "failed": verdicts.count("failed"),
                    "skipped": verdicts.count("skipped"),
                }
            )

    return Recorder()


def harness(argv: list) -> int:
    """`harness.py RESULT_FD KEY_FD WHAT ARGS...`: run the tests, reporting every
    run's counts and then the end on RESULT_FD, each line carrying the key read from KEY_FD."""
    result_fd, key_fd, what, args = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    with os.fdopen(key_fd, "rb") as handle:
        key = handle.read(HARNESS_KEY_BYTES * 2).decode()
    channel = os.fdopen(result_fd, "w", buffering=1)
    runs = []

    def report(counts: dict) -> None:
        runs.append(counts)
        channel.write(json.dumps({"key": key, "run": counts}) + "\n")

    import unittest  # the real one, before the workspace is on the path

    runner = _unittest_recorder(report)
    # As `python -m` or `python script.py` would: the working directory (or the script's
    # directory) first on the path, never this program's own.
    sys.path[0] = os.getcwd() if what in ("unittest", "pytest") else os.path.dirname(what)
    code: object = 0
    try:
        if what == "unittest":
            sys.argv = ["python -m unittest", *args]
            program = unittest.main(module=None, argv=sys.argv, testRunner=runner, exit=False)
            code = 0 if program.result.wasSuccessful() else 1
        elif what == "pytest":
            sys.argv = ["pytest", *args]
            import pytest

            code = int(pytest.main(args, plugins=[_pytest_recorder(report)]))
        else:
            import runpy

            # What unittest.main() runs by default.
            unittest.runner.TextTestRunner = runner  # type: ignore[misc,assignment]
            sys.argv = [what, *args]
            runpy.run_path(what, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    channel.write(json.dumps({"key": key, "end": True, "runs": len(runs)}) + "\n")
    channel.close()
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


# -- harness: end


# Files the agent may not leave for the grader unless the task gave them (remove_shadows).
UNASKED_NAMES = (
    "sitecustomize.py",
    "usercustomize.py",
    "conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "tox.ini",
    "setup.cfg",
)
UNASKED_SUFFIXES = (".pth", ".pyc", ".pyo", ".so", ".pyd")


def unasked(name: str) -> bool:
    return name in UNASKED_NAMES or name.endswith(UNASKED_SUFFIXES)


class TestRun:
    """One run of the task's test command: its exit status and output, how it can be graded,
    and (through the harness) every run's counts and whether the end was reported."""

    __test__ = False  # not a pytest class

    def __init__(
        self, code: int, output: str, graded_by: str, runs: list | None = None, ended: bool = False
    ) -> None:
        self.code = code
        self.output = output
        self.graded_by = graded_by
        self.runs = runs or []
        self.ended = ended
        self.unended = 0  # watched Python processes that never reported their end

    def promise(self) -> dict | None:
        """What a later run must reach (the baseline's): the tests it collected and skipped;
        None when this run cannot say."""
        if self.graded_by != GRADED_BY_RESULTS or not self.ended or not self.runs:
            return None
        counts = tally(self.runs)
        return {"collected": counts["collected"], "skipped": counts["skipped"]}


def judge(rule: str, run: TestRun, promise: dict | None) -> dict:
    """The rule `all` or `fraction` over a test run: the reward event's reward, grade_cause,
    tests_passed, tests_total. Counted runs (the harness) earn a reward only for tests that
    really ran: at least one, every one the task promises (the baseline's count), none failed,
    no more skipped than the baseline skipped, and the end of the run reported."""
    cause: str | None
    if run.graded_by != GRADED_BY_RESULTS:
        cause = None if run.code == 0 else CAUSE_TIMED_OUT if run.code == 124 else CAUSE_FAILED
        if run.unended and run.code != 124:
            cause = CAUSE_EXITED
        return {"reward": 1 if cause is None else 0, "grade_cause": cause,
                "tests_passed": None, "tests_total": None}  # fmt: skip
    counts = tally(run.runs)
    expected = (promise or {}).get("collected", 0)
    allowed_skips = (promise or {}).get("skipped", 0)
    total = max(counts["collected"], expected)
    passed = counts["passed"]
    missing = (
        not run.runs
        or counts["collected"] == 0
        or counts["collected"] < expected
        or counts["skipped"] > allowed_skips
        or passed + counts["skipped"] + counts["failed"] < counts["collected"]
    )
    if run.code == 124:
        cause = CAUSE_TIMED_OUT
    elif not run.ended:
        cause = CAUSE_EXITED
    elif tampered(run.runs):
        cause = CAUSE_TAMPERED
    elif counts["failed"]:
        cause = CAUSE_FAILED
    elif missing:
        cause = CAUSE_MISSING
    elif run.code != 0:
        cause = CAUSE_EXIT_STATUS
    else:
        cause = None
    countable = total - min(counts["skipped"], allowed_skips)
    if cause in (CAUSE_TIMED_OUT, CAUSE_EXITED, CAUSE_TAMPERED) or countable <= 0:
        reward: float = 0
    elif rule == "fraction":
        reward = min(passed, countable) / countable
        if cause is not None and reward >= 1:
            reward = (countable - 1) / countable  # never full reward from a flawed run
    else:
        reward = 1 if cause is None else 0
    if cause is None and reward < 1:
        cause = CAUSE_FAILED
    return {"reward": reward, "grade_cause": cause, "tests_passed": passed, "tests_total": total}


HARNESS_BEGIN = "# -- harness: begin"
HARNESS_END = "# -- harness: end"


def harness_source() -> str:
    """The harness as a program of its own: its part of this file, its imports, its main."""
    # Run as its compiled bytecode, the program's source lies beside it.
    source = __file__[:-1] if __file__.endswith(".pyc") else __file__
    with open(os.path.abspath(source), encoding="utf-8") as handle:
        text = handle.read()
    part = text[text.index(HARNESS_BEGIN) : text.index(HARNESS_END)]
    head = "from __future__ import annotations\nimport json, os, sys\n"
    return head + part + "\nsys.exit(harness(sys.argv[1:]))\n"


def read_records(fd: int, key: str) -> list:
    """The records on a result pipe that carry `key` (closing it): lines without it, or beyond
    MAX_HARNESS_RECORD, are ignored, since the code under test may write to the pipe too."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while len(data) <= MAX_HARNESS_RECORD:
            chunk = os.read(fd, STREAM_READ)
            if not chunk:
                break
            data += chunk
    os.close(fd)
    records = []
    for line in data[:MAX_HARNESS_RECORD].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("key") == key:
            records.append(record)
    return records


def read_harness(fd: int, key: str) -> tuple[list, bool]:
    """(the runs' counts, whether the end was reported) from the harness's pipe."""
    records = read_records(fd, key)
    runs = [r["run"] for r in records if isinstance(r.get("run"), dict)]
    return runs, any(r.get("end") is True for r in records)


# A test command the harness cannot count still runs its Python processes with this watch
# (a sitecustomize module of the grader's, first on PYTHONPATH): each process started by the
# command itself reports its start and, from atexit, its end. One that started and never
# ended left by os._exit or a signal (code under test that exits 0 at import, so that the
# task's script sees a passing check): no reward. The variable is dropped at once, so the
# processes those start are not watched (a test's own server, killed on purpose).
WATCH_ENV = "ROLLOUT_EXIT_WATCH"
WATCH_SOURCE = """import atexit, json, os


def _rollout_watch():
    fd, _, key = os.environ.pop("ROLLOUT_EXIT_WATCH", "").partition(":")
    try:
        fd = int(fd)
        os.write(fd, (json.dumps({"key": key, "start": os.getpid()}) + "\\n").encode())
    except (ValueError, OSError):
        return

    def end():
        try:
            os.write(fd, (json.dumps({"key": key, "end": os.getpid()}) + "\\n").encode())
        except OSError:
            pass

    atexit.register(end)


_rollout_watch()
del _rollout_watch
"""


def unended(records: list, killed: set | frozenset = frozenset()) -> int:
    """How many watched processes started and never reported their end, besides those
    `killed` by the grader because they were still running when the test command ended (a
    server the task's script started in the background)."""
    started = {r["start"] for r in records if isinstance(r.get("start"), int)}
    ended = {r["end"] for r in records if isinstance(r.get("end"), int)}
    return len(started - ended - killed)


def _tally_count(run: dict, name: str) -> int:
    value = run.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def tally(runs: list) -> dict:
    """The counts of every run of one test command, summed."""
    return {
        n: sum(_tally_count(r, n) for r in runs)
        for n in ("collected", "passed", "failed", "skipped")
    }


def tampered(runs: list) -> list:
    """What the code under test replaced of the test machinery, over every run."""
    return sorted(
        {str(n) for r in runs if isinstance(r.get("tampered"), list) for n in r["tampered"]}
    )


# -- agent commands ------------------------------------------------------------------------------
def harden() -> None:
    """Best effort (Linux): the runner adopts the orphans its agent leaves
    (PR_SET_CHILD_SUBREAPER), so kill_leftovers finds them, is not dumpable
    (PR_SET_DUMPABLE 0), so the agent, the same user, can neither open the runner's stdout
    through /proc nor trace it to print events of its own (children are dumpable again after
    exec: nothing changes for them), and, as its PID namespace's init, cannot be signalled
    away by its agent."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        pass
    if os.getpid() == 1:
        # As its namespace's init the runner gets only the signals it handles: Python's
        # SIGINT handler would let the agent end it with KeyboardInterrupt. A handler of its
        # own (not SIG_IGN, which children would inherit) keeps that door shut too.
        signal.signal(signal.SIGINT, lambda *_: None)


def descendants(pid: int) -> list:
    """The live processes below `pid`, from /proc (empty without it)."""
    children: dict = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":  # a zombie is already dead
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def reap() -> None:
    """Collect the exit status of every child that ended (orphans adopted included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_leftovers(group: int | None = None) -> None:
    """Kill what the agent left running: its process group (when given), then every process
    below the runner (the subreaper adopted those that left the group)."""
    if group is not None:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    if os.getpid() == 1:
        # As its PID namespace's init the runner may kill(-1): that spares the caller and
        # PID 1, both the runner here. Never otherwise: outside a namespace of its own, -1
        # reaches every process of the user on the machine.
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
    for _ in range(200):  # a second at most; a killed process is usually gone in a few ms
        reap()
        found = descendants(os.getpid())
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    reap()


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM to the agent's process group, SIGKILL after KILL_GRACE_SECONDS."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(OSError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(OSError):
            process.send_signal(sig)  # in case it left its group
        try:
            process.wait(KILL_GRACE_SECONDS)
            return
        except subprocess.TimeoutExpired:
            continue
    process.wait()


def output_tail(path: str) -> tuple[str, int]:
    """(the last OUTPUT_TAIL_LINES lines, at most OUTPUT_TAIL_BYTES, of a file; its size)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            handle.seek(max(0, size - OUTPUT_TAIL_BYTES))
            data = handle.read(OUTPUT_TAIL_BYTES)
    except OSError:
        return "", 0
    lines = data.decode("utf-8", "replace").splitlines()[-OUTPUT_TAIL_LINES:]
    text = "\n".join(lines).encode("utf-8")[-OUTPUT_TAIL_BYTES:]
    return text.decode("utf-8", "ignore"), size


def run_agent(
    argv: list, env: dict, cwd: str, time_limit: float, stop: threading.Event
) -> dict[str, typing.Any]:
    """Run the agent command to its end, its time (`time_allowed`), or `stop`; then kill
    what it left. The agent_exit event's fields."""
    handle, output = tempfile.mkstemp(prefix="rollout-agent-", suffix=".log")
    started = time.time()
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        os.unlink(output)
        raise EpisodeError(f"the agent command {argv[0]!r} could not start: {exc}") from None
    finally:
        os.close(handle)
    timed_out = False
    while process.poll() is None:
        left = started + time_allowed(time_limit) - time.time()
        if left <= 0:
            timed_out = True
            break
        if stop.wait(min(0.1, left)):
            break
    if process.poll() is None:
        stop_process(process)
    seconds = time.time() - started
    kill_leftovers(process.pid)
    tail, size = output_tail(output)
    with contextlib.suppress(OSError):
        os.unlink(output)
    return {
        "exit_code": None if timed_out else process.returncode,
        "timed_out": timed_out,
        "seconds": seconds,
        "output_tail": tail,
        "output_bytes": size,
    }


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# A reward file is read up to this size, and a reward beyond this magnitude is refused: a file
# the code under test can write must not hand the trainer 1e308 or a gigabyte to parse.
MAX_REWARD_FILE_BYTES = 64 * 1024
MAX_REWARD_MAGNITUDE = 1000.0


class RewardFileProblem(EpisodeError):
    """The tests left no usable reward file: a reward of 0, with the row's grade_cause."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def read_reward(directory: str) -> tuple[float, dict | None]:
    """(reward, other numbers or None) from the first of the verifier's reward files that
    exists. RewardFileProblem naming the file when none does or the one found is not one
    bounded number (or a JSON object with one)."""
    paths = [os.path.join(directory, name) for name in REWARD_FILE_NAMES]
    for path in paths:
        if os.path.lexists(path):
            text = _reward_file_text(path)
            return _reward_json(path, text) if path.endswith(".json") else _reward_text(path, text)
    raise RewardFileProblem(
        f"the tests wrote no reward: none of {', '.join(paths)}", CAUSE_NO_REWARD_FILE
    )


def _bad_reward(message: str) -> RewardFileProblem:
    return RewardFileProblem(message, CAUSE_BAD_REWARD_FILE)


def _reward_file_text(path: str) -> str:
    """A regular file's text, at most MAX_REWARD_FILE_BYTES (never through a link, never a
    FIFO that would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise _bad_reward(f"{path} cannot be read: {exc}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _bad_reward(f"{path} is not a regular file")
        data = handle.read(MAX_REWARD_FILE_BYTES + 1)
    if len(data) > MAX_REWARD_FILE_BYTES:
        raise _bad_reward(f"{path} is larger than {MAX_REWARD_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_reward(f"{path} is not UTF-8 text") from None


def _bounded(value: object) -> bool:
    return _number(value) and math.isfinite(value) and abs(value) <= MAX_REWARD_MAGNITUDE  # type: ignore[arg-type]


def _reward_text(path: str, text: str) -> tuple[float, dict | None]:
    try:
        reward = float(text.strip())
    except ValueError:
        raise _bad_reward(f"{path} does not hold one number") from None
    if not _bounded(reward):
        raise _bad_reward(
            f"{path} holds {reward}, not a finite number within +-{MAX_REWARD_MAGNITUDE:g}"
        )
    return reward, None


def _json_number(text: str) -> float:
    # Integers as floats (a 400-digit integer becomes inf, refused below, instead of an
    # overflow later); NaN and Infinity refused here.
    return float(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _reward_json(path: str, text: str) -> tuple[float, dict | None]:
    """A numeric `reward` (else the only number) of a JSON object; its other numbers are the
    details. A bare number is the reward alone."""
    try:
        value = json.loads(text, parse_int=_json_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise _bad_reward(f"{path} is not JSON: {exc}") from None
    if _number(value):
        value = {"reward": value}
    numbers = {k: v for k, v in value.items() if _bounded(v)} if isinstance(value, dict) else {}
    if isinstance(value, dict) and "reward" in value:
        key = "reward"
    elif len(numbers) == 1:
        key = next(iter(numbers))
    else:
        raise _bad_reward(f"{path} holds no numeric reward (nor a single number)")
    if key not in numbers:
        raise _bad_reward(
            f"{path}: reward {value[key]!r} is not a finite number within "
            f"+-{MAX_REWARD_MAGNITUDE:g}"
        )
    details = {k: float(v) for k, v in numbers.items() if k != key}
    reward = numbers[key]
    return (int(reward) if reward == int(reward) else reward), details or None


# -- the recording proxy -------------------------------------------------------------------------
class EventStream:
    """Server-sent events as they arrive: each complete event's raw bytes, and the JSON chunks
    their data lines carry."""

    BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")

    def __init__(self) -> None:
        self.buffer = b""
        self.chunks: list = []
        self.size = 0

    def feed(self, data: bytes) -> list:
        """[(raw event, whether it is the closing `data: [DONE]`)] that `data` completes."""
        self.size += len(data)
        self.buffer += data
        found: list = []
        while True:
            match = self.BOUNDARY.search(self.buffer)
            if match is None:
                return found
            raw, self.buffer = self.buffer[: match.end()], self.buffer[match.end() :]
            found.append((raw, self.parse(raw[: match.start()])))

    def parse(self, event: bytes) -> bool:
        data = [
            line[5:][1:] if line[5:6] == b" " else line[5:]
            for line in re.split(rb"\r\n|\r|\n", event)
            if line.startswith(b"data:")
        ]
        text = b"\n".join(data).decode("utf-8", "replace").strip()
        if text == "[DONE]":
            return True
        try:
            value = json.loads(text)
        except ValueError:
            return False  # a comment, a keep-alive or junk: forwarded, not assembled
        if isinstance(value, dict):
            self.chunks.append(value)
        return False


def _merge_delta(message: dict, delta: dict) -> None:
    for key, value in delta.items():
        if value is None:
            continue
        if key == "tool_calls" and isinstance(value, list):
            calls = message.setdefault("tool_calls", {})
            for part in value:
                if not isinstance(part, dict):
                    continue
                call = calls.setdefault(part.get("index", len(calls)), {})
                for name, piece in part.items():
                    if name == "function" and isinstance(piece, dict):
                        function = call.setdefault("function", {})
                        for field, text in piece.items():
                            if isinstance(text, str):
                                function[field] = function.get(field, "") + text
                            elif text is not None:
                                function[field] = text
                    elif name in ("id", "type"):
                        call[name] = call.get(name) or piece
                    elif name != "index" and piece is not None:
                        call[name] = piece
        elif key == "role":
            message["role"] = value
        elif isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        else:
            message[key] = value


def assemble_stream(chunks: list) -> dict:
    """One chat.completion from a stream's chat.completion.chunk objects, as the OpenAI client
    accumulates them: texts concatenated, tool calls merged by index, the last finish_reason,
    log-probability entries and token ids concatenated, the other fields (usage, the SGLang
    metadata) as the last chunk that has them says."""
    result: dict = {}
    choices: dict = {}
    for chunk in chunks:
        for key, value in chunk.items():
            if key != "choices" and value is not None:
                result[key] = value
        for part in chunk.get("choices") or []:
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            choice = choices.setdefault(
                index,
                {
                    "index": index,
                    "message": {"role": "assistant", "content": None},
                    "finish_reason": None,
                },
            )
            for key, value in part.items():
                if value is None or key == "index":
                    continue
                if key == "delta" and isinstance(value, dict):
                    _merge_delta(choice["message"], value)
                elif key == "logprobs" and isinstance(value, dict):
                    logprobs = choice.setdefault("logprobs", {})
                    for name, entries in value.items():
                        if isinstance(entries, list):
                            logprobs[name] = (logprobs.get(name) or []) + entries
                        elif entries is not None:
                            logprobs[name] = entries
                elif isinstance(value, list) and isinstance(choice.get(key), list):
                    choice[key] = choice[key] + value
                else:
                    choice[key] = value
    for choice in choices.values():
        calls = choice["message"].get("tool_calls")
        if isinstance(calls, dict):
            choice["message"]["tool_calls"] = [calls[i] for i in sorted(calls, key=_by_index)]
    result["object"] = "chat.completion"
    result["choices"] = [choices[i] for i in sorted(choices, key=_by_index)]
    return result


def _by_index(index: object) -> tuple:
    # Indexes are integers; anything else a server sends sorts after them instead of failing.
    return (0, index, "") if isinstance(index, int) else (1, 0, str(index))


def recorded(raw: bytes, shown: object) -> object:
    """A response as its step records it: `shown` (the ids moved to the token record), or
    the raw answer's size and digest when even that is above MAX_RESPONSE_BYTES."""
    if len(raw) > MAX_RESPONSE_BYTES and _json_size(shown) > MAX_RESPONSE_BYTES:
        return omitted(raw)
    return shown


def omitted(data: bytes) -> dict:
    return {"omitted_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _json_size(value: object) -> int:
    return len(json.dumps(value).encode())


def _cut_texts(value: object) -> object:
    if isinstance(value, str):
        return truncate(value, MAX_MESSAGE_TEXT)[0]
    if isinstance(value, list):
        return [_cut_texts(v) for v in value]
    if isinstance(value, dict):
        return {k: _cut_texts(v) for k, v in value.items()}
    return value


def turn_tokens(response: dict, previous: list) -> tuple[dict, list, dict]:
    """(the step's `tokens` record, the turn's prompt + completion ids, the response to record)
    from a chat completion: the server's own ids (vLLM's top-level `prompt_token_ids` and each
    choice's `token_ids`; SGLang's per choice, `prompt_token_ids` and `response_token_ids`)
    and its log-probabilities, the prompt stored
    beyond what it shares with `previous` (the last turn's prompt + completion). The recorded
    response leaves out the ids (they are in the record, stored once)."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    choice = choice if isinstance(choice, dict) else {}
    prompt = response.get("prompt_token_ids")
    if prompt is None:
        prompt = choice.get("prompt_token_ids")
    completion = choice.get("token_ids")
    if completion is None:
        completion = choice.get("response_token_ids")  # SGLang's name (0.5.23)
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    record: dict
    whole: list = []
    if not isinstance(prompt, list) or not isinstance(completion, list):
        record = {"unavailable": "the server sent no token ids (prompt_token_ids, token_ids)"}
    elif not _all_ints(prompt) or not _all_ints(completion):
        record = {"unavailable": "the server's token ids are not all integers"}
    elif not isinstance(entries, list) or len(entries) != len(completion):
        record = {"unavailable": "the server sent no log-probability per sampled token"}
    else:
        values = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            record = {"unavailable": "a sampled token's log-probability is not a number"}
        else:
            reused = 0
            for ours, theirs in zip(prompt, previous):  # noqa: B905 (Python 3.9 runs this)
                if ours != theirs:
                    break
                reused += 1
            record = {
                "prompt_reused": reused,
                "prompt_ids": prompt[reused:],
                "completion_ids": completion,
                "logprobs": values,
            }
            whole = prompt + completion
    shown = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    if isinstance(choices, list):
        dropped = ("token_ids", "prompt_token_ids", "response_token_ids")
        shown["choices"] = [
            {k: v for k, v in part.items() if k not in dropped} if isinstance(part, dict) else part
            for part in choices
        ]
    return record, whole, shown


def _all_ints(value: object) -> bool:
    return isinstance(value, list) and all(type(i) is int for i in value)


def fit_step(fields: dict) -> dict:
    """The step event's fields within MAX_STEP_EVENT_BYTES: the new messages' long texts cut
    first (messages_truncated), then the largest part left out, its size and digest kept."""
    if _json_size(fields) <= MAX_STEP_EVENT_BYTES:
        return fields
    fields = dict(fields, new_messages=_cut_texts(fields["new_messages"]), messages_truncated=True)
    parts = [key for key in ("request", "new_messages", "response", "tokens") if key in fields]
    for _ in range(len(parts)):
        if _json_size(fields) <= MAX_STEP_EVENT_BYTES:
            break
        key = max(parts, key=lambda k: _json_size(fields[k]))
        if key == "tokens":
            # Ids cut would be a guess: the turn says why it has none.
            size = _json_size(fields[key])
            fields[key] = {"unavailable": f"the turn's token record ({size} bytes) is too large"}
        else:
            fields[key] = omitted(json.dumps(fields[key]).encode())
    return fields


def error_body(message: str, kind: str) -> dict:
    """An error in the OpenAI API's shape, which clients show as the cause."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def is_completion(value: object) -> bool:
    try:
        return isinstance(value["choices"][0]["message"], dict)  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return False


class ProxyHandler(BaseHTTPRequestHandler):
    """The agent's side: GET .../models answered here, POST .../chat/completions forwarded."""

    protocol_version = "HTTP/1.1"
    server: ProxyServer
    # An answer's headers and body are two writes: with Nagle's algorithm the second waits
    # for the agent's delayed ACK of the first (~40 ms a call on a keep-alive connection).
    disable_nagle_algorithm = True
    gone = False  # the agent hung up: the rest of an answer is read, not written

    def log_message(self, format: str, *args: typing.Any) -> None:
        pass  # stdout and stderr carry events only

    def send_body(
        self, status: int, body: bytes, kind: str = "application/json", version: str | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind or "application/json")
            self.send_header("Content-Length", str(len(body)))
            if version:
                self.send_header(VERSION_HEADER, version)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def send_json(self, status: int, value: object) -> None:
        self.send_body(status, json.dumps(value).encode())

    def start_stream(self, version: str | None) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            if version:
                self.send_header(VERSION_HEADER, version)
            self.end_headers()
        except OSError:
            self.gone = self.close_connection = True

    def send_chunk(self, data: bytes, last: bool = False) -> None:
        if self.gone:
            return
        try:
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            if last:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.gone = self.close_connection = True

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        model = {
            "id": self.server.proxy.policy.model,
            "object": "model",
            "created": 0,
            "owned_by": "rollout",
        }
        if path.endswith("/models"):
            self.send_json(200, {"object": "list", "data": [model]})
        elif "/models/" in path:
            self.send_json(200, model)
        else:
            self.send_json(404, error_body(f"no route {self.path}", "not_found"))

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        length = self.headers.get("Content-Length") or ""
        refused = None
        if not length.isdigit():
            refused = 411, error_body("a Content-Length is required", "invalid_request_error")
        elif not path.endswith("/chat/completions"):
            refused = 404, error_body(f"only chat completions are served, not {path}", "not_found")
        elif int(length) > MAX_AGENT_REQUEST:
            refused = 413, error_body("the request is too large", "invalid_request_error")
        if refused is not None:
            self.close_connection = True  # its body is left unread
            self.send_json(*refused)
            return
        try:
            request = json.loads(self.rfile.read(int(length)))
        except ValueError:
            request = None
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            self.send_json(
                400,
                error_body("the body must be a JSON object with messages", "invalid_request_error"),
            )
            return
        try:
            self.server.proxy.exchange(self, request)
        except Exception as exc:
            # A fault of the runner itself: the episode's record cannot be trusted.
            self.server.proxy.fail(f"the runner's proxy failed: {type(exc).__name__}: {exc}")
            self.close_connection = True


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), ProxyHandler)

    def server_bind(self) -> None:
        # HTTPServer would look up 127.0.0.1's name: the sandbox may have no resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "127.0.0.1", int(self.server_address[1])

    def handle_error(self, request: typing.Any, client_address: typing.Any) -> None:
        pass  # an agent hanging up mid-answer; nothing but events goes to stderr


STALE_ANSWER = error_body(
    "the policy moved past this episode's max_policy_lag: the episode is over", "stale_policy"
)


# What an agent's request may set itself: the conversation, its tools, streaming and where
# to stop. Everything else that shapes what is sampled (temperature, top_p, n, logit_bias,
# min_tokens, top_logprobs, seeds, guided decoding, a LoRA adapter, another model) is the
# batch's: the trainer learns from samples drawn under the settings it chose.
AGENT_REQUEST_KEYS = frozenset(
    (
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "user",
    )
)


def agent_request(
    request: dict, sampling: dict, model: str, tokens: dict | None = None
) -> tuple[dict, list]:
    """(the body sent for an agent's request, the names of the agent's keys refused or
    overridden): the agent's conversation keys, then the batch's sampling over them and what
    the trainer's token view needs (`tokens`), on the batch's model."""
    sent = {k: v for k, v in request.items() if k in AGENT_REQUEST_KEYS}
    sent.update(sampling)
    sent.update(tokens or {})
    sent["model"] = model
    refused = sorted(
        k for k, v in request.items() if k != "model" and (k not in sent or sent[k] != v)
    )
    return sent, refused


class Proxy:
    """The agent's OpenAI-compatible endpoint: each chat completion goes to the episode's policy
    (Policy.send: same path, identity headers, retries) and is recorded as a step event."""

    def __init__(self, policy: Policy, identity: dict) -> None:
        self.policy = policy
        self.identity = identity
        self.lock = threading.Lock()
        self.stop = threading.Event()  # the agent must go: stale, or the policy is lost
        self.steps = 0
        self.previous: list | None = None
        self.sequence: list = []  # the last answered turn's prompt + completion ids
        self.first_version: str | None = None
        self.failure: str | None = None
        self.stale: StalePolicy | None = None
        self.closed = False
        self.server = ProxyServer(self)
        # Polled this often for close(): a stop costs the episode at most that long.
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def start(self) -> Proxy:
        self.thread.start()
        return self

    def close(self) -> None:
        """Nothing counts after this: exchanges still in flight are neither recorded nor can
        they change the outcome (the log would not show why)."""
        with self.lock:
            self.closed = True
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def fail(self, cause: str) -> None:
        with self.lock:
            if not self.closed:
                self.failure = self.failure or cause
                self.stop.set()

    def too_stale(self, version: str | None) -> bool:
        """Whether `version` lags the first exchange's by more than max_policy_lag (then the
        episode is stale and the agent is stopped)."""
        bound = self.policy.max_policy_lag
        with self.lock:
            if self.stale is not None or self.closed:
                return self.stale is not None
            lag = version_lag(self.first_version, version) if self.steps else None
            if bound is None or lag is None or lag <= bound:
                return False
            first = str(self.first_version)
            self.stale = StalePolicy(first, str(version), lag, bound, self.steps)
            self.stop.set()
            return True

    def exchange(self, handler: ProxyHandler, request: dict) -> None:
        if self.stop.is_set():
            handler.send_json(
                409 if self.stale is not None else 502,
                error_body("the episode is over: no more completions", "rollout_stopped"),
            )
            return
        policy = self.policy
        sent, refused = agent_request(request, policy.sampling, policy.model, policy.token_request)
        asked = time.time()
        try:
            answer = self.policy.send(
                json.dumps(sent).encode(), keep_open=sent.get("stream") is True
            )
        except InfrastructureError as exc:
            lost = Answer(0, b"", None, self.policy.retries + 1, "")
            self.record(sent, asked, lost, failure=str(exc), error=str(exc), refused=refused)
            handler.send_json(502, error_body(str(exc), "policy_unreachable"))
            return
        relay = self.relay_stream if answer.response is not None else self.relay
        relay(handler, sent, asked, answer, refused)

    def relay(
        self, handler: ProxyHandler, sent: dict, asked: float, answer: Answer, refused: list
    ) -> None:
        raw, status = answer.raw, answer.status
        if len(raw) > MAX_RESPONSE_READ:
            # What the policy generated under the batch's settings: the agent's turn, told
            # so, never an infrastructure failure (that would erase the sample).
            cause = f"policy response exceeds {MAX_RESPONSE_READ} bytes"
            self.record(sent, asked, answer, error=cause, refused=refused)
            handler.send_json(502, error_body(cause, "policy_response_too_large"))
            return
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        version = policy_version(answer.header, parsed)
        failure = None
        if status == 200 and is_completion(parsed):
            if self.too_stale(version):
                LEDGER.turn(parsed, time.time() - asked)  # answered, though never recorded
                handler.send_json(409, STALE_ANSWER)
                return
        elif status == 200:
            failure = f"policy endpoint sent no chat completion: {raw[:200]!r}"
        elif status == 429 or status >= 500:
            failure = (
                f"policy endpoint answered HTTP {status}: {raw[:200]!r} "
                f"(after {answer.attempts} attempt(s))"
            )
        ok = status == 200 and failure is None
        self.record(
            sent,
            asked,
            answer,
            version=version,
            response=parsed if ok else None,
            raw=raw,
            failure=failure,
            error=None if ok else raw[:MAX_ERROR_BODY].decode("utf-8", "replace"),
            refused=refused,
        )
        # Recorded before the agent reads it: its next request finds this step in the log.
        handler.send_body(status, raw, answer.content_type, answer.header)

    def relay_stream(
        self, handler: ProxyHandler, sent: dict, asked: float, answer: Answer, refused: list
    ) -> None:
        conn, upstream = answer.conn, answer.response
        assert conn is not None and upstream is not None
        if self.too_stale(policy_version(answer.header, None)):
            conn.close()
            LEDGER.turn(None, time.time() - asked)
            handler.send_json(409, STALE_ANSWER)
            return
        handler.start_stream(answer.header)
        events = EventStream()
        held: list = []
        problem = None
        too_large = False
        try:
            while True:
                data = upstream.read1(STREAM_READ)
                if not data:
                    break
                for raw, done in events.feed(data):
                    # [DONE] waits until the exchange is recorded, as a whole answer does.
                    if done or held:
                        held.append(raw)
                    else:
                        handler.send_chunk(raw)
                if events.size > MAX_RESPONSE_READ:
                    problem = f"policy response exceeds {MAX_RESPONSE_READ} bytes"
                    too_large = True  # the agent's turn, as a whole answer's (relay)
                    break
        except (OSError, http.client.HTTPException) as exc:
            problem = f"policy stream cut: {type(exc).__name__}: {exc}"
        finally:
            conn.close()
        if problem is None and not events.chunks:
            problem = "policy endpoint sent an event stream without chunks"
        assembled = assemble_stream(events.chunks)
        version = policy_version(answer.header, assembled)
        if problem is None and self.too_stale(version):
            LEDGER.turn(assembled, time.time() - asked)
            handler.close_connection = True  # no end: the agent is stopped anyway
            return
        self.record(
            sent,
            asked,
            answer,
            version=version,
            response=assembled if events.chunks else None,
            raw=json.dumps(assembled).encode(),
            failure=None if too_large else problem,
            error=problem,
            chunks=len(events.chunks),
            refused=refused,
        )
        if problem is not None:
            handler.close_connection = True  # cut, as the agent would have seen it
            return
        handler.send_chunk(b"".join(held) + events.buffer, last=True)

    def record(
        self,
        sent: dict,
        asked: float,
        answer: Answer,
        *,
        version: str | None = None,
        response: dict | None = None,
        raw: bytes = b"",
        failure: str | None = None,
        error: str | None = None,
        chunks: int | None = None,
        refused: list | None = None,
    ) -> None:
        answered = time.time()
        with self.lock:
            if self.closed:
                return
            LEDGER.turn(response, answered - asked)
            if failure is not None:
                self.failure = self.failure or failure
                self.stop.set()
            self.steps += 1
            messages = sent["messages"]
            previous = self.previous
            reset = previous is not None and messages[: len(previous)] != previous
            new = messages if previous is None or reset else messages[len(previous) :]
            self.previous = messages
            if self.steps == 1:
                self.first_version = version
            verbatim: object = response
            tokens = None
            if response is not None:
                tokens, self.sequence, verbatim = self.policy.tokens_of(response, self.sequence)
                verbatim = recorded(raw, verbatim)
            fields: dict = {
                "step": self.steps,
                "request": {k: v for k, v in sent.items() if k != "messages"},
                "new_messages": new,
                "messages_reset": reset,
                "response": verbatim,
                "status": answer.status or None,
                "error": error,
                "stream": chunks is not None,
                "policy_seconds": answered - asked,
                "policy_attempts": answer.attempts,
                "policy_version": version,
            }
            if tokens is not None:
                fields["tokens"] = tokens
            if chunks is not None:
                fields["chunks"] = chunks
            if refused:
                fields["request_refused"] = refused
            emit("step", **fit_step(fields), **self.identity)


class Runner:
    def __init__(self, task: dict, policy: Policy | None, identity: dict, root: str) -> None:
        self.task = task
        self.policy = policy
        self.identity = identity
        self.root = root
        self.max_steps = int(task.get("max_steps", 10))
        self.time_limit = float(task.get("time_limit_seconds", 60))
        # The test command's own limit (Harbor's [verifier] timeout_sec), not the agent's.
        self.test_timeout = float(task.get("test_timeout_seconds", TESTS_TIMEOUT_SECONDS))
        self.agent: typing.Any = task.get("agent")
        self.mode = "agent" if self.agent is None else ORACLE if self.agent == ORACLE else "command"
        self.tests_dir = TESTS_DIR
        self.promise: dict | None = None  # the baseline's counts, when it ran and counted
        # Where /tests, /solution and /logs/verifier are made: those paths, unless the runner's
        # environment names others (a sandbox without a root of its own; tests).
        self.places = {
            name: os.environ.get(name) or default
            for name, default in (
                ("ROLLOUT_TESTS_DIR", TESTS_DIR),
                ("ROLLOUT_SOLUTION_DIR", SOLUTION_DIR),
                ("ROLLOUT_VERIFIER_DIR", VERIFIER_DIR),
            )
        }
        shim = tempfile.mkdtemp(prefix="rollout-bin-")
        for name in ("python", "python3"):
            os.symlink(sys.executable, os.path.join(shim, name))
        self.env = {
            "PATH": f"{shim}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": root,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def need_policy(self) -> Policy:
        if self.policy is None:
            raise InfrastructureError("no policy for this episode (ROLLOUT_POLICY is not set)")
        return self.policy

    def test_argv(self) -> list:
        """The task's test command, naming the directory that stands in for /tests (when the
        tests are elsewhere)."""
        argv = list(self.task["test_command"])
        if self.tests_dir == TESTS_DIR:
            return argv
        return [
            self.tests_dir + a[len(TESTS_DIR) :]
            if a == TESTS_DIR or a.startswith(TESTS_DIR + "/")
            else a
            for a in argv
        ]

    def remove_shadows(self) -> list:
        """What the agent added that would run in the grader unasked, removed before the final
        tests (the task's own files of the same names stay): modules named like the standard
        library's at the top of the repository (a `unittest.py` wins over the real one);
        anywhere, interpreter start-up hooks (`sitecustomize`, `usercustomize`, `*.pth`),
        pytest's configuration and hooks (`conftest.py`, `pytest.ini`, `tox.ini`, `setup.cfg`)
        and compiled modules (`__pycache__`, `*.pyc`, `*.so`: they load before or instead of
        the source)."""
        names = set(getattr(sys, "stdlib_module_names", ())) | {"sitecustomize", "usercustomize"}
        given = set(self.task.get("files") or {}) | set(self.task.get("test_files") or {})
        tops = {path.split("/")[0] for path in given}
        removed = []
        for entry in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, entry)
            package = os.path.isdir(path) and not os.path.islink(path)
            stem = entry[:-3] if entry.endswith(".py") else entry
            if stem not in names or entry in tops or not (package or entry.endswith(".py")):
                continue
            if package:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(entry)
        for folder, dirs, files in os.walk(self.root):
            relative = os.path.relpath(folder, self.root)
            for name in list(dirs):
                if name == "__pycache__":
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
                    dirs.remove(name)
                    removed.append(os.path.normpath(os.path.join(relative, name)))
            for name in files:
                path = os.path.normpath(os.path.join(relative, name))
                if path in given or not unasked(name):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
                    removed.append(path)
        return removed

    def run_tests(self, extra_env: dict | None = None) -> TestRun:
        try:
            write_files(self.root, self.task.get("test_files") or {})
        except (OSError, ValueError) as exc:
            raise EpisodeError(f"the task's test_files cannot be written: {exc}") from None
        shutil.rmtree(os.path.join(self.root, "__pycache__"), ignore_errors=True)
        env = dict(self.env, **(extra_env or {}))
        argv = self.test_argv()
        plan = harness_plan(argv)
        key = os.urandom(HARNESS_KEY_BYTES).hex()
        results_read, results_write = os.pipe()
        if plan is None or (plan[1] not in ("unittest", "pytest") and not self.counts(plan[1])):
            folder = tempfile.mkdtemp(prefix="rollout-watch-")
            with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as out:
                out.write(WATCH_SOURCE)
            env["PYTHONPATH"] = ":".join(filter(None, (folder, env.get("PYTHONPATH"))))
            env[WATCH_ENV] = f"{results_write}:{key}"
            try:
                code, output, killed = run_process(
                    resolve_argv(argv, env["PATH"]),
                    env,
                    self.root,
                    self.test_timeout,
                    (results_write,),
                )
            finally:
                os.close(results_write)
                shutil.rmtree(folder, ignore_errors=True)
            run = TestRun(code, output, GRADED_BY_EXIT)
            run.unended = unended(read_records(results_read, key), killed)
            return run
        flags, what, args = plan
        key_read, key_write = os.pipe()
        os.write(key_write, key.encode())
        os.close(key_write)
        # Written anew for every run, after the agent is gone: nothing it left can be the
        # harness. -E and -s: no PYTHON* variable and no user site folder (under $HOME, the
        # workspace) reaches the interpreter that runs the tests.
        folder = tempfile.mkdtemp(prefix="rollout-harness-")
        program = os.path.join(folder, "harness.py")
        with open(program, "w", encoding="utf-8") as handle:
            handle.write(harness_source())
        command = [sys.executable, "-E", "-s", *flags, program]
        command += [str(results_write), str(key_read), what, *args]
        try:
            code, output, _ = run_process(
                command, env, self.root, self.test_timeout, (results_write, key_read)
            )
        finally:
            os.close(results_write)
            os.close(key_read)
            shutil.rmtree(folder, ignore_errors=True)
        runs, ended = read_harness(results_read, key)
        return TestRun(code, output, GRADED_BY_RESULTS, runs, ended)

    def counts(self, script: str) -> bool:
        """Whether a test script is one the harness can count: it runs unittest (a script of
        plain asserts keeps its exit status)."""
        try:
            with open(os.path.join(self.root, script), "rb") as handle:
                return b"unittest" in handle.read(MAX_REWARD_FILE_BYTES)
        except OSError:
            return False

    def wants_baseline(self) -> bool:
        """The tests must fail before the agent acts, unless the task says otherwise or its
        tests only come (at /tests) after the agent."""
        return bool(self.task.get("baseline", True)) and not self.task.get("tests")

    def setup(self) -> None:
        try:
            write_files(self.root, self.task.get("files") or {})
            write_files(self.root, self.task.get("test_files") or {})
        except (OSError, ValueError) as exc:
            raise EpisodeError(f"the task's files cannot be written: {exc}") from None

    def run(self) -> int:
        """The episode up to its outcome: reward, or grade_pending with `grade: fresh`."""
        policy = None if self.mode == ORACLE else self.need_policy()
        self.setup()
        ready: dict = {"mode": self.mode}
        if policy is not None:
            ready["policy_base_url"] = policy.base_url
        if self.mode == "command":
            ready["agent_command"] = list(self.agent["command"])
        emit("ready", **ready, **self.identity)
        baseline_exit = None
        if self.wants_baseline():
            baseline = self.run_tests()
            baseline_exit = baseline.code
            if baseline_exit == 0:
                raise EpisodeError(
                    "the task's tests pass before any action; a task must start failing"
                )
            self.promise = baseline.promise()
        if self.mode == "agent":
            steps, stop_reason = self.loop()
            acted: dict = {"steps": steps, "stop_reason": stop_reason}
        else:
            acted = self.act()
        acted["baseline_exit"] = baseline_exit
        acted["baseline_tests"] = self.promise
        if self.task.get("grade", "same") == "fresh" or os.environ.get(GRADER_ENV) == "sandbox":
            # The tests run in another sandbox: over a copy of the workspace alone (fresh), or
            # (same) over this one's workspace, /tmp and /logs, where a backend that keeps the
            # tests out of the agent's reach (ROLLOUT_GRADER=sandbox) gives them. Nothing of
            # the agent's may run on into the grading (a Pod's next container shares these
            # folders), and the baseline's counts go where that grader reads them.
            kill_leftovers()
            hand_over(self.promise)
            record_outcome(emit("grade_pending", **acted, **self.identity))
            return 0
        record_outcome(emit("reward", **self.grade(), **acted, grade="same", **self.identity))
        return 0

    def grade_phase(self) -> int:
        """ROLLOUT_PHASE=grade: the tests of a `grade: fresh` episode, over the workspace its
        agent left (its baseline and agent fields are in the first sandbox's grade_pending)."""
        if self.task.get("grade", "same") == "fresh":
            # A backend whose grader shares folders with the agent's sandbox (a Pod's
            # containers) names them: `fresh` receives the workspace alone.
            for shared in filter(None, os.environ.get(SHARED_DIRS_ENV, "").split(":")):
                try:
                    empty_folder(shared)
                except OSError as exc:
                    raise EpisodeError(f"{shared} cannot be emptied for grading: {exc}") from None
            remove_special_files(self.root)
        emit("ready", mode="grade", **self.identity)
        # The agent's sandbox's baseline counts, passed on by the backend from its
        # grade_pending (written before the agent acted).
        with contextlib.suppress(ValueError, TypeError):
            promise = json.loads(os.environ.get(BASELINE_TESTS_ENV) or handed_over() or "null")
            self.promise = promise if isinstance(promise, dict) else None
        fields = self.grade()
        grade = self.task.get("grade", "same")
        record_outcome(emit("reward", **fields, baseline_exit=None, grade=grade, **self.identity))
        return 0

    def grade(self) -> dict:
        """Place the tests, run them, apply the reward rule: the reward event's fields."""
        # Nothing the agent started may still run (a daemon rewriting files): the built-in
        # loop's commands and an agent command's leftovers are gone before the tests start.
        kill_leftovers()
        env = {"ROLLOUT_WORKSPACE": self.root}
        tests = self.task.get("tests") or {}
        if tests:
            self.tests_dir = fresh_dir(self.places["ROLLOUT_TESTS_DIR"], "rollout-tests-")
            try:
                write_files(self.tests_dir, tests, scripts=True)
            except (OSError, ValueError) as exc:
                raise EpisodeError(f"the task's tests cannot be written: {exc}") from None
            env["ROLLOUT_TESTS_DIR"] = self.tests_dir
        rule = self.task.get("reward", "all")
        verifier = None
        if rule == "file" or tests:
            # Only then: a task of files and test_files alone leaves the machine's / untouched
            # (its runner may run outside a sandbox, in tests or without isolation).
            verifier = fresh_dir(self.places["ROLLOUT_VERIFIER_DIR"], "rollout-verifier-")
            env["ROLLOUT_VERIFIER_DIR"] = verifier
        removed = self.remove_shadows()
        run = self.run_tests(env)
        details = None
        if rule == "file" and verifier is not None:
            verdict = judge("all", run, self.promise)
            verdict["reward"], verdict["grade_cause"] = 0, None
            try:
                if run.code < 0 or run.code == 124 or run.unended:
                    # Killed by a signal (code under test that kills the script before it
                    # writes its verdict, after planting one), a Python process of the tests
                    # that never ended (exit 0 at import) or cut at the time limit: what the
                    # reward file holds is no verdict of the tests.
                    cause = CAUSE_TIMED_OUT if run.code == 124 else CAUSE_EXITED
                    raise RewardFileProblem(f"the tests ended with status {run.code}", cause)
                reward, details = read_reward(verifier)
                verdict["reward"] = reward
                if reward < 1:
                    verdict["grade_cause"] = CAUSE_REWARD_FILE
            except RewardFileProblem as problem:
                verdict["grade_cause"] = problem.cause
                run.output += f"\n[{problem}]"
            graded_by = GRADED_BY_FILE
        else:
            verdict = judge(rule, run, self.promise)
            graded_by = run.graded_by
            if verdict["grade_cause"] == CAUSE_TAMPERED:
                run.output += f"\n[the code under test replaced {', '.join(tampered(run.runs))}]"
        shown, _ = truncate(run.output)
        return {
            **verdict,
            "reward_rule": rule,
            "reward_details": details,
            "graded_by": graded_by,
            "tests_exit": run.code,
            "tests_output": shown,
            "tests_promised": (self.promise or {}).get("collected"),
            "removed_before_tests": removed,
        }

    def act(self) -> dict:
        """Run the agent command (or the oracle's solve.sh) to its end or its time limit, then
        emit agent_exit. The outcome's fields; InfrastructureError when the policy was lost,
        StalePolicy when it moved on too far."""
        env = dict(self.env)
        statement = str(self.task["statement"])
        handle, statement_file = tempfile.mkstemp(prefix="rollout-statement-", suffix=".txt")
        with os.fdopen(handle, "w") as out:
            out.write(statement)
        env["ROLLOUT_STATEMENT"] = truncate(statement, MAX_ENV_STATEMENT)[0]
        env["ROLLOUT_STATEMENT_FILE"] = statement_file
        env["ROLLOUT_WORKSPACE"] = self.root
        proxy = None
        if self.mode == ORACLE:
            solution = fresh_dir(self.places["ROLLOUT_SOLUTION_DIR"], "rollout-solution-")
            try:
                write_files(solution, self.task.get("solution") or {}, scripts=True)
            except (OSError, ValueError) as exc:
                raise EpisodeError(f"the task's solution cannot be written: {exc}") from None
            env["ROLLOUT_SOLUTION_DIR"] = solution
            argv = ["bash", os.path.join(solution, "solve.sh")]
        else:
            own = dict(self.agent.get("env") or {})
            path = own.pop("PATH", None)
            env.update({str(k): str(v) for k, v in own.items()})
            if path:
                env["PATH"] = f"{path}:{self.env['PATH']}"
            argv = list(self.agent["command"])
        argv = resolve_argv(argv, env["PATH"])
        if self.mode == "command":
            policy = self.need_policy()
            proxy = Proxy(policy, self.identity).start()
            env["OPENAI_BASE_URL"] = env["OPENAI_API_BASE"] = proxy.base_url
            env["OPENAI_API_KEY"] = API_KEY
            env["OPENAI_MODEL"] = policy.model
        try:
            run = run_agent(
                argv, env, self.root, self.time_limit, proxy.stop if proxy else threading.Event()
            )
        finally:
            if proxy is not None:
                proxy.close()
            with contextlib.suppress(OSError):
                os.unlink(statement_file)
        emit("agent_exit", **run, **self.identity)
        if proxy is not None and proxy.failure is not None:
            raise InfrastructureError(proxy.failure)
        if run["timed_out"]:
            check_time_limit(self.time_limit)
        if proxy is not None and proxy.stale is not None:
            raise proxy.stale
        return {
            "steps": proxy.steps if proxy is not None else 0,
            "stop_reason": "time_limit" if run["timed_out"] else "agent_exit",
            "agent_exit_code": run["exit_code"],
            "agent_output": run["output_tail"],
            "agent_seconds": run["seconds"],
        }

    def prompt(self) -> list:
        """The same for every sample of the task: nothing episode-specific is shown."""
        files = sorted(set(self.task.get("files") or {}) | set(self.task.get("test_files") or {}))
        text = (
            f"{self.task['statement']}\n\nFiles: {', '.join(files)}\n"
            f"Tests: {' '.join(self.task['test_command'])}\n"
            f"You have {self.max_steps} turns. Call submit when done."
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]

    def execute(self, name: str, args: dict, deadline: float) -> tuple[str, bool]:
        """(observation, submitted)."""
        if name == "submit":
            return "submitted", True
        if name == "write_file":
            content = args.get("content")
            if not isinstance(content, str):
                return "error: write_file needs a string 'content'", False
            full = workspace_path(self.root, args.get("path"))
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as handle:
                handle.write(content)
            return f"wrote {len(content.encode())} bytes to {args.get('path')}", False
        if name == "read_file":
            with open(workspace_path(self.root, args.get("path")), errors="replace") as handle:
                return handle.read(MAX_OBSERVATION_BYTES * 4), False
        if name == "run":
            command = args.get("command")
            if not isinstance(command, str):
                return "error: run needs a string 'command'", False
            timeout = min(COMMAND_TIMEOUT_SECONDS, deadline - time.time())
            code, output = run_command(command, timeout, self.env)
            return f"exit code {code}\n{output}", False
        return f"error: unknown tool {name!r}; use write_file, read_file, run or submit", False

    @staticmethod
    def actions(message: dict) -> tuple[list, str | None]:
        """The turn's actions [(call id, name, arguments or an error)], or why there are none."""
        calls = message.get("tool_calls") or []
        if calls:
            found = []
            for call in calls:
                function = call.get("function") or {}
                try:
                    args = json.loads(function.get("arguments") or "{}")
                    if not isinstance(args, dict):
                        raise ValueError("arguments are not an object")
                except ValueError as exc:
                    args = {"__error__": f"arguments are not a JSON object: {exc}"}
                found.append((call.get("id"), str(function.get("name")), args))
            return found, None
        content = message.get("content")
        # A reply without tool calls may carry one action as a JSON object in its text.
        try:
            value = json.loads(content) if isinstance(content, str) else None
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("tool"), str):
            args = value.get("arguments") if isinstance(value.get("arguments"), dict) else {}
            return [(None, value["tool"], args)], None
        return [], "malformed reply: no tool call and no JSON action"

    def loop(self) -> tuple[int, str]:
        """Ask, act, observe until submit or a limit: (steps, stop reason)."""
        messages = self.prompt()
        started = time.time()
        step = 0
        first_version: str | None = None
        sequence: list = []  # the last turn's prompt + completion ids
        while True:
            if step >= self.max_steps:
                return step, "max_steps"
            deadline = started + time_allowed(self.time_limit)
            if time.time() >= deadline:
                check_time_limit(self.time_limit)
                return step, "time_limit"
            step += 1
            asked = time.time()
            try:
                response, raw, attempts, header = self.need_policy().complete(messages)
            except InfrastructureError:
                LEDGER.turn(None, time.time() - asked)  # waited on, never answered
                raise
            except ResponseTooLarge:
                LEDGER.turn(None, time.time() - asked)
                return step - 1, "response_too_large"
            answered = time.time()
            LEDGER.turn(response, answered - asked)
            version = policy_version(header, response)
            if step == 1:
                first_version = version
            lag = version_lag(first_version, version)
            bound = self.need_policy().max_policy_lag
            if bound is not None and lag is not None and lag > bound:
                # This turn's actions come from a policy too far from the first turn's: none of
                # them runs, and the episode ends without tests (its steps so far are logged).
                raise StalePolicy(str(first_version), str(version), lag, bound, step - 1)
            message = response["choices"][0]["message"]
            messages.append(message)
            actions, problem = self.actions(message)
            records = []
            submitted = False
            for call_id, name, args in actions:
                began = time.time()
                try:
                    if "__error__" in args:
                        raise ValueError(args["__error__"])
                    observation, done = self.execute(name, args, deadline)
                except (OSError, ValueError) as exc:
                    observation, done = f"error: {exc}", False
                submitted = submitted or done
                shown, cut = truncate(observation)
                records.append(
                    {
                        "tool": name,
                        "arguments": {k: v for k, v in args.items() if k != "__error__"},
                        "observation": shown,
                        "observation_bytes": len(observation.encode("utf-8", "replace")),
                        "truncated": cut,
                        "seconds": time.time() - began,
                    }
                )
                if call_id is not None:
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": shown})
                else:
                    messages.append({"role": "user", "content": f"Observation:\n{shown}"})
            if problem:
                messages.append(
                    {
                        "role": "user",
                        "content": "Your reply had no action. Call one of the tools "
                        "(write_file, read_file, run, submit).",
                    }
                )
            tokens, sequence, kept = self.need_policy().tokens_of(response, sequence)
            emit(
                "step",
                step=step,
                tokens=tokens,
                actions=records,
                error=problem,
                policy_seconds=answered - asked,
                policy_attempts=attempts,
                policy_version=version,
                action_seconds=time.time() - answered,
                response=recorded(raw, kept),
                **self.identity,
            )
            if submitted:
                return step, "submit"


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
    try:
        with open(path, encoding="utf-8") as handle:
            tasks = json.load(handle)
        os.unlink(path)
    except (OSError, ValueError) as exc:
        raise InfrastructureError(f"the hidden tests cannot be taken out of reach: {exc}") from None
    return {t["id"]: t["tests"] for t in tasks if isinstance(t, dict) and t.get("tests")}


def load_task(identity: dict, hidden: dict | None = None) -> dict:
    with open(os.environ["ROLLOUT_TASKS_FILE"]) as handle:
        tasks = json.load(handle)
    if isinstance(tasks, dict):
        tasks = tasks.get("tasks", [])
    for task in tasks:
        if task.get("id") == identity["task_id"]:
            tests = (hidden or {}).get(task["id"])
            return dict(task, tests=tests) if tests else task
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


# The baseline's counts ({collected, skipped}, JSON) for a grading sandbox, from its agent
# sandbox's grade_pending.
BASELINE_TESTS_ENV = "ROLLOUT_BASELINE_TESTS"
# A folder the agent's runner and its grader share (a Pod's init container and container):
# the baseline's counts travel there when no backend passes BASELINE_TESTS_ENV.
HANDOFF_ENV = "ROLLOUT_HANDOFF_DIR"
HANDOFF_NAME = "baseline.json"


def hand_over(promise: dict | None) -> None:
    """Leave the baseline's counts for the grader (after every agent process is gone: written
    to a new file and renamed over whatever the agent left at that name)."""
    folder = os.environ.get(HANDOFF_ENV)
    if not folder:
        return
    target = os.path.join(folder, HANDOFF_NAME)
    with contextlib.suppress(OSError):
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        handle, temporary = tempfile.mkstemp(dir=folder)
        with os.fdopen(handle, "w") as out:
            json.dump(promise, out)
        os.replace(temporary, target)


def handed_over() -> str | None:
    folder = os.environ.get(HANDOFF_ENV)
    if not folder:
        return None
    try:
        fd = os.open(os.path.join(folder, HANDOFF_NAME), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as handle:
            return handle.read(4096)
    except (OSError, UnicodeDecodeError):
        return None


# Set by a backend whose grader shares folders with the agent's sandbox besides the
# workspace (Kubernetes: the Pod's /tmp, /logs and /dev/shm), ':'-separated.
SHARED_DIRS_ENV = "ROLLOUT_SHARED_DIRS"
# Set by a backend that grades in a second sandbox whatever the task's `grade` (the local one,
# for tasks whose tests the agent must not see): the agent's sandbox then ends with
# grade_pending.
GRADER_ENV = "ROLLOUT_GRADER"


def agent(workspace: str) -> int:
    try:
        hidden = take_hidden_tests()
        identity = episode_identity()
        task = load_task(identity, hidden)
        raw = os.environ.get("ROLLOUT_POLICY")
        config = json.loads(raw) if raw else None
        phase = os.environ.get("ROLLOUT_PHASE") or "agent"
        if phase not in ("agent", "grade"):
            raise ValueError(f"ROLLOUT_PHASE {phase!r} is not agent or grade")
    except (OSError, ValueError, KeyError, IndexError, InfrastructureError) as exc:
        record_outcome(
            emit("error", kind="infrastructure", cause=f"no task for this episode: {exc}")
        )
        return EXIT_INFRASTRUCTURE
    root = os.path.realpath(workspace)
    policy = Policy(config, os.environ["EPISODE_ID"], identity) if config is not None else None
    runner = Runner(task, policy, identity, root)
    harden()
    try:
        return runner.grade_phase() if phase == "grade" else runner.run()
    except EpisodeError as exc:
        record_outcome(emit("error", kind="episode", cause=str(exc), **identity))
        return EXIT_EPISODE_ERROR
    except InfrastructureError as exc:
        record_outcome(emit("error", kind="infrastructure", cause=str(exc), **identity))
        return EXIT_INFRASTRUCTURE
    except StalePolicy as stale:
        # Exit 0: stopped on purpose, so neither a Job failure nor an infrastructure retry.
        record_outcome(emit("stale", **stale.fields, **identity))
        return 0


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
    handover = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in handover["env"].items()})
    if "tasks" in handover:
        with open(os.environ["ROLLOUT_TASKS_FILE"], "w") as handle:
            json.dump(handover["tasks"], handle)
    if isinstance(handover.get("hidden_tests"), dict):
        HANDED_TESTS.update(handover["hidden_tests"])
    return True


def main() -> int:
    if os.environ.get("ROLLOUT_HANDOVER") == "stdin" and not take_handover(sys.stdin):
        return 0
    workspace = os.environ.get("ROLLOUT_WORKSPACE", "/workspace")
    os.chdir(workspace)
    if os.environ.get("ROLLOUT_POLICY") or os.environ.get("ROLLOUT_TASKS_FILE"):
        return agent(workspace)
    return demo(os.environ.get("ROLLOUT_ACTION", "fix"))


if __name__ == "__main__":
    sys.exit(main())
