"""One RL episode in a sandbox: prepare the task, let the agent act, test, report a reward.

Runs with any Python >= 3.9 and only the standard library (python:3.12-alpine has nothing
else), as an unprivileged user, in its own workspace. Its stdout carries the JSON events the
workers validate, one per line.

Two modes:

- The guide's demo (no ROLLOUT_POLICY): the built-in shipping task and a fixed action
  (ROLLOUT_ACTION fix | none | hang). Exactly two events, `ready` and `reward`; the exit status
  is 0 only when the tests pass after the action.
- The agent runner (ROLLOUT_POLICY set): the episode's task comes from ROLLOUT_TASKS_FILE; the
  policy is asked for actions through the OpenAI-compatible chat completions API at
  `<policy>/rollout/<episode id>/v1/chat/completions`, every request carrying the episode's
  group id. Actions (write_file, read_file, run, submit) run here, in the workspace; their
  observations go back to the policy, until submit, the step limit or the time limit. Then the
  task's tests run and the reward rule applies (`all`: 1 when every test passes, else 0;
  `fraction`: passed / total). Events: `ready`, one `step` per policy turn (the turn's actions,
  each observation truncated to MAX_OBSERVATION_BYTES with TRUNCATION_MARKER, timings, and the
  server's whole response verbatim, token ids and log-probabilities included when it sends
  them, and the turn's `policy_version`), then `reward`; or an `error` event with a `kind`
  (`infrastructure`: the policy endpoint was unreachable, timed out or answered with something
  that is not a chat completion; `episode`: the task is broken) and no reward; or, with
  `max_policy_lag` set, a `stale` event (first_version, version, lag, max_policy_lag, steps)
  when the policy answering a turn is more than that many versions past the one that
  answered the first turn: the episode stops there, no tests, no reward. A turn's version is
  the `X-Policy-Version` response header, else the body's `weight_version` or
  `metadata.weight_version` (SGLang), else null; only integer versions are compared. Exit
  status: 0 with a reward (whatever its value) or stale (a withdrawn episode, not a failure
  nor one to retry), 3 for an episode error, 4 for an infrastructure error.

Environment: EPISODE_ID (the sandbox's name), ROLLOUT_WORKSPACE (default /workspace),
ROLLOUT_ACTION; for the agent runner ROLLOUT_POLICY (JSON: model, sampling,
request_timeout_seconds, max_retries, optionally max_policy_lag), ROLLOUT_POLICY_SOCKET (a
unix socket that forwards to the policy; the local backend) or ROLLOUT_POLICY_URL (the
policy's root URL; Kubernetes),
ROLLOUT_TASKS_FILE, and either ROLLOUT_TASK_ID / ROLLOUT_SAMPLE / ROLLOUT_GROUP_ID or
JOB_COMPLETION_INDEX (+ ROLLOUT_INDEX_OFFSET, the first episode of its Job) /
ROLLOUT_SAMPLES_PER_TASK / ROLLOUT_BATCH_ID to work them out;
ROLLOUT_ATTEMPT (0 for the first run of this episode, n for its n-th retry in a fresh sandbox
after an infrastructure failure), sent to the policy as X-Rollout-Attempt.
A warm sandbox (ROLLOUT_HANDOVER=stdin) gets the episode's variables on stdin instead (see
take_handover).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.parse

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
MAX_RESPONSE_READ = 8 * 2**20
COMMAND_TIMEOUT_SECONDS = 30
TESTS_TIMEOUT_SECONDS = 60
GROUP_HEADER = "X-Rollout-Group-Id"
VERSION_HEADER = "X-Policy-Version"
# A version is a label, not a payload: a longer one is cut so events stay small.
MAX_VERSION_CHARS = 128
INTEGER = re.compile(r"-?[0-9]+")

EXIT_EPISODE_ERROR = 3
EXIT_INFRASTRUCTURE = 4

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


def emit(event: str, **data: object) -> dict[str, object]:
    record = {"event": event, "at": time.time(), "episode_id": os.environ["EPISODE_ID"]}
    record.update(data)
    sys.stdout.write(json.dumps(record) + "\n")
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
        summary = {k: event.get(k) for k in keys}
        if event.get("event") in ("error", "stale"):
            summary[str(event["event"])] = True
        try:
            with open(TERMINATION_LOG, "w") as handle:
                handle.write(json.dumps(summary))
        except OSError:
            pass


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
        self.socket_path = os.environ.get("ROLLOUT_POLICY_SOCKET")
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

    def connection(self) -> http.client.HTTPConnection:
        if self.socket_path:
            return UnixHTTPConnection(self.socket_path, self.timeout)
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.netloc, timeout=self.timeout)
        return http.client.HTTPConnection(self.netloc, timeout=self.timeout)

    def complete(self, messages: list) -> tuple[dict, bytes, int, str | None]:
        """(parsed response, raw bytes, attempts, X-Policy-Version header or None). Retries
        connection failures, timeouts, 429 and 5xx; raises InfrastructureError when they are
        spent or the answer is no chat completion."""
        body = dict(self.sampling)
        body.update({"model": self.model, "messages": messages, "tools": TOOLS})
        payload = json.dumps(body).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
            conn = self.connection()
            try:
                conn.request("POST", self.path, body=payload, headers=self.headers)
                response = conn.getresponse()
                raw = response.read(MAX_RESPONSE_READ + 1)
                status = response.status
                header = response.getheader(VERSION_HEADER)
            except (OSError, http.client.HTTPException) as exc:
                kind = "timed out" if isinstance(exc, socket.timeout) else "unreachable"
                problem = f"policy endpoint {kind}: {type(exc).__name__}: {exc}"
                continue
            finally:
                conn.close()
            if status == 429 or status >= 500:
                problem = f"policy endpoint answered HTTP {status}: {raw[:200]!r}"
                continue
            if status != 200:
                raise InfrastructureError(
                    f"policy endpoint refused the request: HTTP {status}: {raw[:200]!r}"
                )
            if len(raw) > MAX_RESPONSE_READ:
                raise InfrastructureError(f"policy response exceeds {MAX_RESPONSE_READ} bytes")
            try:
                parsed = json.loads(raw)
                message = parsed["choices"][0]["message"]
                if not isinstance(message, dict):
                    raise TypeError("message is not an object")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise InfrastructureError(
                    f"policy endpoint sent no chat completion ({exc}): {raw[:200]!r}"
                ) from None
            return parsed, raw, attempt + 1, header
        raise InfrastructureError(f"{problem} (after {self.retries + 1} attempt(s))")


def workspace_path(root: str, path: object) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        raise ValueError(f"path must be a relative path in the repository, got {path!r}")
    full = os.path.realpath(os.path.join(root, path))
    if full != root and not full.startswith(root + os.sep):
        raise ValueError(f"path {path!r} leaves the repository")
    return full


def write_files(root: str, files: dict) -> None:
    for path, text in files.items():
        full = workspace_path(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as handle:
            handle.write(text)


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


def test_counts(output: str) -> tuple[int | None, int | None]:
    """(passed, total) from unittest's (or pytest's) summary; (None, None) if not found."""
    ran = re.search(r"^Ran (\d+) tests? in", output, re.MULTILINE)
    if ran:
        total = int(ran.group(1))
        tail = output.split(ran.group(0))[-1]
        broken = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", tail))
        return total - broken, total
    passed = re.search(r"(\d+) passed", output)
    failed = re.findall(r"(\d+) (?:failed|error)", output)
    if passed or failed:
        p = int(passed.group(1)) if passed else 0
        return p, p + sum(int(n) for n in failed)
    return None, None


class Runner:
    def __init__(self, task: dict, policy: Policy, identity: dict, root: str) -> None:
        self.task = task
        self.policy = policy
        self.identity = identity
        self.root = root
        self.max_steps = int(task.get("max_steps", 10))
        self.time_limit = float(task.get("time_limit_seconds", 60))
        shim = tempfile.mkdtemp(prefix="rollout-bin-")
        for name in ("python", "python3"):
            os.symlink(sys.executable, os.path.join(shim, name))
        self.env = {
            "PATH": f"{shim}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": root,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def test_command(self) -> list:
        argv = list(self.task["test_command"])
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    def remove_shadows(self) -> list:
        """Files the agent added that would replace the standard library (a `unittest.py`
        in the repository wins over the real one) are removed before the final tests."""
        names = set(getattr(sys, "stdlib_module_names", ())) | {"sitecustomize", "usercustomize"}
        given = set(self.task["files"]) | set(self.task.get("test_files") or {})
        tops = {path.split("/")[0] for path in given}
        removed = []
        for entry in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, entry)
            package = os.path.isdir(path)
            stem = entry[:-3] if entry.endswith(".py") else entry
            if stem not in names or entry in tops or not (package or entry.endswith(".py")):
                continue
            if package:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(entry)
        return removed

    def run_tests(self) -> tuple[int, str]:
        write_files(self.root, self.task.get("test_files") or {})
        shutil.rmtree(os.path.join(self.root, "__pycache__"), ignore_errors=True)
        try:
            done = subprocess.run(
                self.test_command(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=TESTS_TIMEOUT_SECONDS,
                env=self.env,
                cwd=self.root,
            )
        except subprocess.TimeoutExpired:
            return 124, f"[tests timed out after {TESTS_TIMEOUT_SECONDS}s]"
        return done.returncode, done.stdout.decode("utf-8", "replace")

    def prompt(self) -> list:
        """The same for every sample of the task: nothing episode-specific is shown."""
        files = sorted(set(self.task["files"]) | set(self.task.get("test_files") or {}))
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
        deadline = started + self.time_limit
        step = 0
        first_version: str | None = None
        while True:
            if step >= self.max_steps:
                return step, "max_steps"
            if time.time() >= deadline:
                return step, "time_limit"
            step += 1
            asked = time.time()
            response, raw, attempts, header = self.policy.complete(messages)
            answered = time.time()
            version = policy_version(header, response)
            if step == 1:
                first_version = version
            lag = version_lag(first_version, version)
            bound = self.policy.max_policy_lag
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
            verbatim: object = response
            if len(raw) > MAX_RESPONSE_BYTES:
                verbatim = {
                    "omitted_bytes": len(raw),
                    "sha256": hashlib.sha256(raw).hexdigest(),
                }
            emit(
                "step",
                step=step,
                actions=records,
                error=problem,
                policy_seconds=answered - asked,
                policy_attempts=attempts,
                policy_version=version,
                action_seconds=time.time() - answered,
                response=verbatim,
                **self.identity,
            )
            if submitted:
                return step, "submit"


def load_task(identity: dict) -> dict:
    with open(os.environ["ROLLOUT_TASKS_FILE"]) as handle:
        tasks = json.load(handle)
    if isinstance(tasks, dict):
        tasks = tasks.get("tasks", [])
    for task in tasks:
        if task.get("id") == identity["task_id"]:
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


def agent(workspace: str) -> int:
    episode_id = os.environ["EPISODE_ID"]
    try:
        identity = episode_identity()
        task = load_task(identity)
    except (OSError, ValueError, KeyError, IndexError, InfrastructureError) as exc:
        record_outcome(
            emit("error", kind="infrastructure", cause=f"no task for this episode: {exc}")
        )
        return EXIT_INFRASTRUCTURE
    root = os.path.realpath(workspace)
    policy = Policy(json.loads(os.environ["ROLLOUT_POLICY"]), episode_id, identity)
    runner = Runner(task, policy, identity, root)
    write_files(root, task["files"])
    write_files(root, task.get("test_files") or {})
    emit("ready", mode="agent", policy_base_url=policy.base_url, **identity)
    baseline_exit, _ = runner.run_tests()
    if baseline_exit == 0:
        emit(
            "error",
            kind="episode",
            cause="the task's tests pass before any action; a task must start failing",
            **identity,
        )
        return EXIT_EPISODE_ERROR
    try:
        steps, stop_reason = runner.loop()
    except InfrastructureError as exc:
        record_outcome(emit("error", kind="infrastructure", cause=str(exc), **identity))
        return EXIT_INFRASTRUCTURE
    except StalePolicy as stale:
        # Exit 0: stopped on purpose, so neither a Job failure nor an infrastructure retry.
        record_outcome(emit("stale", **stale.fields, **identity))
        return 0
    removed = runner.remove_shadows()
    tests_exit, tests_output = runner.run_tests()
    passed, total = test_counts(tests_output)
    rule = task.get("reward", "all")
    if rule == "fraction" and total:
        reward: float = (passed or 0) / total
    else:
        reward = 1 if tests_exit == 0 else 0
    if tests_exit != 0 and reward >= 1:
        reward = (total - 1) / total if total else 0  # never full reward with a failing run
    shown, _ = truncate(tests_output)
    event = emit(
        "reward",
        reward=reward,
        reward_rule=rule,
        baseline_exit=baseline_exit,
        tests_exit=tests_exit,
        tests_output=shown,
        tests_passed=passed,
        tests_total=total,
        steps=steps,
        stop_reason=stop_reason,
        removed_before_tests=removed,
        **identity,
    )
    record_outcome(event)
    return 0


def take_handover(stream: typing.TextIO) -> bool:
    """A warm sandbox (ROLLOUT_HANDOVER=stdin) was started before its episode existed: it
    waits here, interpreter and imports done, for the one line that makes it an episode
    (written through the API server's attach, so the sandbox's network stays closed). The line
    is JSON: `env` (the variables a cold sandbox gets from its Pod spec) and, for real rollouts,
    `tasks` (this episode's task, written to ROLLOUT_TASKS_FILE). False when stdin closed
    without a line (the pool was drained): there is no episode to run."""
    line = stream.readline()
    if not line.strip():
        return False
    handover = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in handover["env"].items()})
    if "tasks" in handover:
        with open(os.environ["ROLLOUT_TASKS_FILE"], "w") as handle:
            json.dump(handover["tasks"], handle)
    return True


def main() -> int:
    if os.environ.get("ROLLOUT_HANDOVER") == "stdin" and not take_handover(sys.stdin):
        return 0
    workspace = os.environ.get("ROLLOUT_WORKSPACE", "/workspace")
    os.chdir(workspace)
    if os.environ.get("ROLLOUT_POLICY"):
        return agent(workspace)
    return demo(os.environ.get("ROLLOUT_ACTION", "fix"))


if __name__ == "__main__":
    sys.exit(main())
