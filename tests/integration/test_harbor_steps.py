"""Harbor's multi-step tasks ([[steps]]) end to end on the local backend (real Redis, workers
and bubblewrap sandboxes): `rollout run --tasks DIR --agent oracle --all-in-one --output`.
Each step's agent then its tests run in the episode's one sandbox, in order; the row keeps
each step's reward and the episode's is the strategy's combination. The oracle earns full
reward; one that solves step 1 only earns step 1's; a step below its min_reward ends the
episode; no step's agent can read a later step's tests or statement (nor an earlier step's
tests); a planted reward file or tests that exit 0 without a verdict earn the step 0. An agent
command of its own acts on each step by the statement it gets, and sees no later step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.workers]

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "harbor" / "multi-step" / "two-steps"
# Reward 1 when step.txt reads exactly $1.
REWARD_IF = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat step.txt 2>/dev/null)" = "{want}" ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""
# Split so that the scripts holding it (step 1's own solution) do not match themselves.
SECRET = "LATER" + "-STEP-" + "SECRET-8841"
PEEK = f"""#!/bin/bash
# Step 1's agent: look for step 2's tests and statement wherever this sandbox lets it look.
found=$(grep -rl "{SECRET[:5]}""{SECRET[5:]}" /tests /sandbox /solution /logs /tmp . 2>/dev/null)
ls -A /tests > tests-seen.txt 2>&1
if [ -z "$found" ]; then echo none > peek.txt; else echo "$found" > peek.txt; fi
echo one > step.txt
"""
PEEK_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat peek.txt)" = none ] && [ ! -s tests-seen.txt ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""
# Step 2's agent: step 1's tests are gone from /tests before it starts.
AFTER = """#!/bin/bash
ls -A /tests > tests-seen-2.txt 2>&1
echo two >> step.txt
"""
AFTER_TEST = f"""#!/bin/bash
# {SECRET}
mkdir -p /logs/verifier
if [ ! -s tests-seen-2.txt ] && [ "$(cat step.txt)" = "$(printf 'one\\ntwo')" ]; then echo 1
else echo 0; fi > /logs/verifier/reward.txt
"""
PLANT = """#!/bin/bash
mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && echo 1 > /logs/verifier/reward.json
"""
EXIT_0 = "#!/bin/bash\nexit 0\n"


def steps_task(root: Path, name: str, steps: list[dict[str, Any]], head: str = "") -> None:
    """A multi-step Harbor task: each step {name, statement, test, solve, toml}."""
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "README").write_text("a multi-step task\n")
    toml = head + "[agent]\ntimeout_sec = 20\n[verifier]\ntimeout_sec = 20\n"
    for step in steps:
        toml += f'[[steps]]\nname = "{step["name"]}"\n{step.get("toml", "")}'
        base = folder / "steps" / step["name"]
        (base / "tests").mkdir(parents=True)
        (base / "solution").mkdir()
        (base / "instruction.md").write_text(step["statement"])
        (base / "tests" / "test.sh").write_text(step["test"])
        (base / "solution" / "solve.sh").write_text(step["solve"])
    (folder / "task.toml").write_text(toml)


def one_two(**first: Any) -> list[dict[str, Any]]:
    """Step 1 writes `one` to step.txt, step 2 appends `two` (each graded on the whole file)."""
    return [
        {
            "name": "first",
            "statement": "Write one to step.txt.\n",
            "test": REWARD_IF.format(want="one"),
            "solve": "#!/bin/bash\necho one > step.txt\n",
        }
        | first,
        {
            "name": "second",
            "statement": "Append two to step.txt.\n",
            "test": REWARD_IF.format(want="$(printf 'one\\ntwo')"),
            "solve": "#!/bin/bash\necho two >> step.txt\n",
        },
    ]


def test_steps_run_in_order_in_one_sandbox_and_the_row_keeps_each_reward(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copytree(FIXTURE, tasks / "two-steps")
    only_first = one_two()
    only_first[1]["solve"] = "#!/bin/bash\ntrue\n"  # solves step 1 only
    steps_task(tasks, "only-first-mean", only_first)
    steps_task(tasks, "only-first-final", only_first, 'multi_step_reward_strategy = "final"\n')
    gated = one_two(solve="#!/bin/bash\necho wrong > step.txt\n", toml="min_reward = 1.0\n")
    steps_task(tasks, "gated", gated)
    hidden = one_two(solve=PEEK, test=PEEK_TEST)
    hidden[1] |= {"statement": f"Append two. {SECRET}\n", "solve": AFTER, "test": AFTER_TEST}
    steps_task(tasks, "no-peek", hidden)
    steps_task(tasks, "planted", one_two(solve=PLANT))
    planted_exit = one_two(solve=PLANT, test=EXIT_0)
    steps_task(tasks, "exit-zero", planted_exit)
    output = tmp_path / "records"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", "oracle", "--json", "--all-in-one", "--output", str(output)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((output / "results.json").read_text())
    rows = {r["task_id"]: r for r in report["pods"]}
    groups = {g["task_id"]: g for g in report["groups"]}
    # The report's groups say how each step fared across the samples that ran it.
    assert groups["only-first-mean"]["step_rewards"] == [
        {"name": "first", "runs": 1, "mean": 1.0},
        {"name": "second", "runs": 1, "mean": 0.0},
    ]
    assert groups["gated"]["step_rewards"] == [{"name": "first", "runs": 1, "mean": 0.0}]
    assert all(r["status"] == "ok" and not r["errors"] for r in rows.values()), rows

    def rewards(task: str) -> list[tuple[str, float]]:
        return [(s["name"], s["reward"]) for s in rows[task]["step_rewards"]]

    # The oracle earns full reward, each step its own.
    assert rows["two-steps"]["reward"] == 1
    assert rewards("two-steps") == [("make-file", 1), ("extend-file", 1)]
    # Step 1 solved, step 2 not: the mean of both, or the last one's.
    assert rewards("only-first-mean") == [("first", 1), ("second", 0)]
    assert rows["only-first-mean"]["reward"] == 0.5
    assert rows["only-first-mean"]["grade_cause"] == "reward_file"
    assert rewards("only-first-final") == [("first", 1), ("second", 0)]
    assert rows["only-first-final"]["reward"] == 0
    # Below its min_reward, step 1 ends the episode: step 2 never runs (Harbor leaves it out).
    assert rewards("gated") == [("first", 0)] and rows["gated"]["reward"] == 0
    # Step 1's agent found neither step 2's tests nor its statement, and /tests was empty for
    # both agents (step 2's tests check step 2's view).
    assert rewards("no-peek") == [("first", 1), ("second", 1)], rows["no-peek"]
    # A reward file planted by the agent is gone before the step's tests; tests that exit 0
    # without writing one earn nothing either.
    assert rewards("planted") == [("first", 0), ("second", 0)]
    assert rows["planted"]["step_rewards"][0]["grade_cause"] == "reward_file"
    assert rewards("exit-zero") == [("first", 0), ("second", 0)]
    assert rows["exit-zero"]["reward"] == 0


def test_the_built_in_loop_runs_once_per_step_and_its_steps_go_on_numbering(open_tmp_path):
    """The built-in agent loop on the fixture, with the scripted policy: each step a fresh
    conversation on the step's statement (the policy's turn counter starts again, so one plan
    serves both steps), its step events numbered on across the steps, the row valid."""
    from rollout_wire.harbor import scan
    from rollout_wire.request import parse_spec
    from rollout_wire.trajectory import trajectory_from_log
    from rollout_worker.backends.local.backend import LocalBackend
    from rollout_worker.cli.policy_server import running
    from rollout_worker.settings import Settings
    from rollout_worker.validation import validate_episode

    (mapped,) = scan(FIXTURE)
    grow = "if [ -f step.txt ]; then echo two >> step.txt; else echo one > step.txt; fi"
    plan = [{"tool": "run", "arguments": {"command": grow}}, {"tool": "submit", "arguments": {}}]
    script = {"name": "steps", "tasks": {"two-steps": {"plans": [plan]}}}
    backend = LocalBackend(
        Settings(local_root=open_tmp_path / "runs", redis_url="redis://127.0.0.1:9/0")
    )
    with running(script=script) as server:
        policy = {"model": "scripted", "request_timeout_seconds": 10, "max_retries": 0}
        spec = parse_spec(
            {"tasks": [mapped.task], "policy": policy | {"url": server.url}}, max_episodes=10
        )
        handle = backend.start_run(spec, lambda fields: None)
        observed = backend.wait_episode(handle, 0, 120)
        log = backend.read_output(handle, observed)
        row = validate_episode(observed, log, handle.origin)
        backend.finish_run(spec, handle)
        backend.delete_run(handle)
    assert row.status == "ok", (row.errors, log[:3000])
    assert [(s["name"], s["reward"]) for s in row.step_rewards or []] == [
        ("make-file", 1),
        ("extend-file", 1),
    ]
    assert row.reward == 1 and row.steps == 4
    trajectory = trajectory_from_log(log)
    assert [s["step"] for s in trajectory["steps"]] == [1, 2, 3, 4]


# An agent command of its own (not the oracle, not the built-in loop), acting on each step by
# the statement it is given: the right fix for make-file, a wrong one for extend-file. At each
# step it reports what it can see: /tests, and any trace of a later step's statement or tests
# (extend-file's statement and its test's `one\ntwo`) outside its own statement. The patterns
# are split so that this script, readable in its folder, never matches them itself.
STEP_AGENT = r"""#!/bin/bash
case "$ROLLOUT_STATEMENT" in
    *"single line \`one\`"*) step=make-file; echo one > step.txt ;;
    *"Append a sec""ond line"*) step=extend-file; echo three >> step.txt ;;
    *) step=unknown ;;
esac
later=$( {
    grep -rlF -e "Append a sec""ond" -e 'one\n''two' /tests /sandbox /solution /logs /tmp . \
        2>/dev/null | grep -vxF "$ROLLOUT_STATEMENT_FILE"
    env | grep -v '^ROLLOUT_STATEMENT=' | grep -F -e "Append a sec""ond" -e 'one\n''two' \
        | cut -d= -f1
} | tr '\n' ' ')
echo "step=$step tests=[$(ls -A /tests 2>&1 | tr '\n' ' ')] later=[$later]"
"""


def test_an_agent_command_acts_on_each_step_and_never_sees_a_later_one(open_tmp_path):
    """`rollout run --agent COMMAND` on the multi-step fixture: the command runs once per step
    with that step's statement (its own file, shown read-only with --agent-env), does step 1
    right and step 2 wrong; the row keeps each step's reward (1, then 0: step.txt reads one,
    three) and the episode's is their mean; each run of the agent found /tests empty and no
    trace of a later step's statement or tests."""
    tasks = open_tmp_path / "tasks"
    tasks.mkdir()
    shutil.copytree(FIXTURE, tasks / "two-steps")
    agent = open_tmp_path / "agent"
    agent.mkdir()
    (agent / "step_agent.sh").write_text(STEP_AGENT)
    output = open_tmp_path / "records"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", f"bash {agent / 'step_agent.sh'}", "--agent-env", str(agent)),
            *("--policy-url", "http://127.0.0.1:9", "--json", "--all-in-one"),
            *("--output", str(output)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((output / "results.json").read_text())["pods"]
    assert row["status"] == "ok" and not row["errors"], row
    assert [(s["name"], s["reward"]) for s in row["step_rewards"]] == [
        ("make-file", 1),
        ("extend-file", 0),
    ], row
    assert row["reward"] == 0.5
    (log,) = output.glob("rollout-*-0.log")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    said = [e["output_tail"].strip() for e in events if e.get("event") == "agent_exit"]
    assert said == [
        "step=make-file tests=[] later=[]",
        "step=extend-file tests=[] later=[]",
    ], said
