"""The episode in its sandbox: set up, baseline, the agent, then grading or a hand-over."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import typing

from .cost import check_time_limit
from .errors import EpisodeError, InfrastructureError
from .events import emit, record_outcome, truncate
from .grader import Grader
from .handoff import BASELINE_TESTS_ENV, GRADER_ENV, SHARED_DIRS_ENV, hand_over, handed_over
from .health import check_fresh_grader, run_healthcheck
from .loop import AgentLoop
from .multistep import agent_part, pod_step, run_steps
from .policy import Policy
from .processes import kill_leftovers, resolve_argv, run_agent
from .workspace import empty_folder, fresh_dir, remove_special_files, write_files

# The agent a task names: a command of its own, or the oracle (its solution).
ORACLE = "oracle"
API_KEY = "rollout"  # the agent's OPENAI_API_KEY: clients insist on one, the proxy ignores it
# Linux refuses an environment variable above 128 KiB; the whole statement is in its file.
MAX_ENV_STATEMENT = 64 * 1024


class Runner(Grader, AgentLoop):
    """One episode's sandbox part: its task set up, the baseline, the agent (the built-in loop,
    an agent command or the oracle), then the grading here or a hand-over to a grader."""

    def __init__(self, task: dict, policy: Policy | None, identity: dict, root: str) -> None:
        super().__init__(task, root)
        self.policy = policy
        self.identity = identity
        self.max_steps = int(task.get("max_steps", 10))
        self.time_limit = float(task.get("time_limit_seconds", 60))
        self.agent: typing.Any = task.get("agent")
        self.mode = "agent" if self.agent is None else ORACLE if self.agent == ORACLE else "command"
        # What the agent's processes (the built-in loop's commands too) run with: the task's
        # [environment.env], never [verifier.env] or [solution.env].
        self.agent_env = {**self.env, **self.task_env.get("environment", {})}

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
        self.need_task_env()
        policy = None if self.mode == ORACLE else self.need_policy()
        self.setup()
        if self.task.get("healthcheck"):
            # Before `ready`: the agent starts only in an environment that passed it.
            run_healthcheck(self.task["healthcheck"], self.agent_env, self.root)
        ready: dict = {"mode": self.mode}
        if policy is not None:
            ready["policy_base_url"] = policy.base_url
        if self.mode == "command":
            ready["agent_command"] = list(self.agent["command"])
        emit("ready", **ready, **self.identity)
        if self.task.get("steps"):
            if pod_step() is not None:  # step 1's agent; its tests in the next container
                return agent_part(self, 1)
            fields = run_steps(self)
            record_outcome(emit("reward", **fields, grade="same", **self.identity))
            return 0
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
        self.need_task_env()
        check_fresh_grader(self.task, self.agent_env, self.root)  # before `ready`, as run()'s
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

    def act(self) -> dict:
        """Run the agent command (or the oracle's solve.sh) to its end or its time limit, then
        emit agent_exit. The outcome's fields; InfrastructureError when the policy was lost,
        StalePolicy when it moved on too far."""
        env = dict(self.agent_env)
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
            env.update(self.task_env.get("solution", {}))  # Harbor's [solution.env]
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
            # Only here: its server imports http.server (a lazy module, program.py).
            from .proxy import Proxy

            policy = self.need_policy()
            proxy = Proxy(policy, self.identity).start()
            proxy.offset = self.step_offset
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
