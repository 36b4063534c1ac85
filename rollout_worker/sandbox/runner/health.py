"""A task's healthcheck (Harbor's [environment.healthcheck]): run in the sandbox before the
agent starts, and again in a fresh grader's sandbox before the tests, until it passes or its
retries run out."""

from __future__ import annotations

import time

from .errors import InfrastructureError
from .events import truncate
from .processes import run_process

HEALTH_OUTPUT_CHARS = 2000


def run_healthcheck(check: dict, env: dict, cwd: str) -> dict:
    """Run `check["command"]` (sh -c, in `cwd`, with the agent's environment: the task's
    [environment.env]) until it exits 0, as Docker's HEALTHCHECK does: `timeout_seconds` per
    attempt, `start_interval_seconds` apart during the first `start_period_seconds` (whose
    failures do not count), then `interval_seconds` apart; `retries` counted failures in a row
    end it. The attempts and seconds it took, or InfrastructureError: an environment that
    never became ready is no sample of the policy (its agent never started): the runner's
    `infrastructure` kind, as a sandbox that never got ready (validation.failure_kind), kept
    out of every reward figure and run again under the batch's retry budget, since a service
    slow to come up may come up in a fresh sandbox; `episode` is for an episode that broke a
    rule, which this one never had the chance to."""
    started = time.time()
    attempts = failures = 0
    retries = int(check.get("retries", 3))
    while True:
        attempts += 1
        code, output, _ = run_process(
            ["/bin/sh", "-c", str(check["command"])],
            env,
            cwd,
            float(check.get("timeout_seconds", 30)),
        )
        if code == 0:
            return {"attempts": attempts, "seconds": time.time() - started}
        in_start_period = time.time() - started < float(check.get("start_period_seconds", 0))
        if not in_start_period:
            failures += 1
            if failures >= retries:
                tail = truncate(output[-HEALTH_OUTPUT_CHARS:])[0].strip()
                raise InfrastructureError(
                    f"the task's healthcheck did not pass: {failures} failure(s) in a row "
                    f"after {attempts} attempt(s) in {time.time() - started:.0f}s, the last "
                    f"exit status {code}" + (f": {tail}" if tail else "")
                )
        pause = "start_interval_seconds" if in_start_period else "interval_seconds"
        time.sleep(float(check.get(pause, 5)))


def check_fresh_grader(task: dict, env: dict, cwd: str) -> dict | None:
    """A `grade: fresh` grader's sandbox is a new environment (Harbor's separate verifier
    environment, whose healthcheck passed before its verifier ran): the task's healthcheck runs
    there too, before the tests, with what it ran with in the agent's sandbox (`env`: the
    task's [environment.env]) and in the workspace handed over. One that never passes is the
    same InfrastructureError as in the agent's sandbox: the tests never ran in a ready
    environment, so no reward is given. A `same` grader continues the agent's environment
    (whose check passed): nothing runs; None."""
    if task.get("grade", "same") != "fresh" or not task.get("healthcheck"):
        return None
    return run_healthcheck(task["healthcheck"], env, cwd)
