"""A Harbor task with hidden tests, acted on by the built-in agent loop (a policy, no agent
command) on the local backend, in real bubblewrap sandboxes: the tests reach the grader only,
so a right fix earns 1, a wrong one 0, and the policy's commands find no test anywhere.

Before the fix the loop's episode got no grader's sandbox and no /tests: every such episode,
a right fix included, earned 0 with `status: ok` ("/tests/test.sh: No such file")."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.workers]

TASK = Path(__file__).resolve().parents[1] / "data" / "harbor" / "add-numbers"
FIX = "printf 'def add(a, b):\\n    return a + b\\n' > calc.py"
WRONG = "printf 'def add(a, b):\\n    return a - b\\n' > calc.py"
# What it finds is the command's output, recorded in the episode's log (the name is split in
# the command so that only a found file can print it whole).
LOOK = (
    "echo looked-$((1+1)); ls -A /tests; grep -rl 'check''_add' / --include='*.py' 2>/dev/null; "
    + FIX
)


def run_plans(root: Path, plans: list[list[dict]]) -> list:
    from rollout_wire.harbor import scan
    from rollout_wire.request import parse_spec
    from rollout_worker.backends.local.backend import LocalBackend
    from rollout_worker.cli.policy_server import running
    from rollout_worker.settings import Settings
    from rollout_worker.validation import validate_episode

    (mapped,) = scan(TASK)
    task_id = mapped.task["id"]
    script = {"name": "builtin-loop", "tasks": {task_id: {"plans": plans}}}
    backend = LocalBackend(Settings(local_root=root / "runs", redis_url="redis://127.0.0.1:9/0"))
    rows, logs = [], []
    with running(script=script) as server:
        policy = {"model": "scripted", "request_timeout_seconds": 10, "max_retries": 0}
        spec = parse_spec(
            {
                "tasks": [mapped.task],
                "samples_per_task": len(plans),
                "policy": policy | {"url": server.url},
            },
            max_episodes=10,
        )
        handle = backend.start_run(spec, lambda fields: None)
        for index in range(len(plans)):
            observed = backend.wait_episode(handle, index, 120)
            log = backend.read_output(handle, observed)
            rows.append(validate_episode(observed, log, handle.origin))
            logs.append(log)
        backend.finish_run(spec, handle)
        backend.delete_run(handle)
    return list(zip(rows, logs, strict=True))


def plan(command: str) -> list[dict]:
    return [{"tool": "run", "arguments": {"command": command}}, {"tool": "submit", "arguments": {}}]


def test_the_built_in_loop_on_a_task_with_hidden_tests_is_graded_by_them(open_tmp_path):
    right, wrong, look = run_plans(open_tmp_path, [plan(FIX), plan(WRONG), plan(LOOK)])
    for row, log in (right, wrong, look):
        assert row.status == "ok", (row.errors, log[-2000:])
        assert row.graded_by == "reward_file", log[-2000:]
    assert right[0].reward == 1, right[1][-2000:]
    # Graded by the tests (their verdict in the output), not lost for want of them.
    assert wrong[0].reward == 0 and "add(1, 2) = -1, want 3" in wrong[1], wrong[1][-2000:]
    # The looker's fix is right, so its 1 also says the tests ran; what it saw is nothing.
    assert look[0].reward == 1, look[1][-2000:]
    acting = look[1].split('"event": "grade_pending"')[0]
    assert "looked-2" in acting  # its output is in the log, so a find would be too
    assert "check_add" not in acting
