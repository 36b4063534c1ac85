"""The red team through real sandboxes (the local backend: bubblewrap, the real supervisor,
Celery workers and Redis), under both grade modes: every reward-hacking agent of
tests/red_team.py earns 0 with its cause on the row, and the honest fix still earns 1, on the
bundled task and on a Harbor task (hidden tests, a script that writes the reward file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_wire.tasksets import load_task_set
from tests.red_team import HARBOR_HONEST, HARBOR_TRICKS, HONEST, SANDBOX_TRICKS, TRICKS

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

HARBOR = Path(__file__).resolve().parents[2] / "tests" / "data" / "harbor"
NEVER_ASKED = {"url": "http://127.0.0.1:9"}  # no agent here asks the policy


def red_team_tasks(grade: str) -> list[dict]:
    shipping = load_task_set("bundled", ["shipping-boundary"])[0]
    tasks = [
        shipping | {"id": f"hack-{name.replace('_', '-')}", "grade": grade, "agent": agent(source)}
        for name, (source, _) in sorted((TRICKS | SANDBOX_TRICKS).items())
    ]
    tasks.append(shipping | {"id": "honest", "grade": grade, "agent": agent(HONEST)})
    add = load_task_set(str(HARBOR), ["add-numbers"])[0]
    tasks += [
        add | {"id": name, "grade": grade, "agent": agent(source)}
        for name, (source, _) in HARBOR_TRICKS.items()
    ]
    tasks.append(add | {"id": "harbor-honest", "grade": grade, "agent": agent(HARBOR_HONEST)})
    for task in tasks:
        if task["id"] == "harbor-look-for-tests":
            # It reads every file of its sandbox, the worker's virtualenv (torch's tens of
            # thousands of files) included: more than the task's own 30 s on a loaded machine,
            # and a killed search prints nothing (CI, 2026-12-05: agent_output '').
            task["time_limit_seconds"] = 90
    return tasks


def assert_expected_grades(rows: dict[str, dict]) -> None:
    """Every hack's row: reward 0 with its cause; the honest fixes' rows: 1, no cause."""
    expected = {
        f"hack-{name.replace('_', '-')}": (0, cause)
        for name, (_, cause) in (TRICKS | SANDBOX_TRICKS).items()
    }
    expected["honest"] = (1, None)
    expected |= {name: (0, cause) for name, (_, cause) in HARBOR_TRICKS.items()}
    expected["harbor-honest"] = (1, None)
    got = {task: (row["reward"], row["grade_cause"]) for task, row in rows.items()}
    assert got == expected, {t: rows[t]["errors"] or rows[t]["failure_cause"] for t in rows}


def agent(source: str) -> dict:
    return {"command": ["python", "-c", source]}


@pytest.mark.parametrize("grade", ["same", "fresh"])
def test_every_red_team_agent_earns_nothing_in_real_sandboxes(stack, client, grade):
    tasks = red_team_tasks(grade)
    batch = client.submit(tasks=tasks, samples_per_task=1, parallelism=4, policy=NEVER_ASKED)
    report = client.wait(batch.batch_id, timeout=600)
    assert report["run_isolation"] == "bwrap"
    rows = {row["task_id"]: row for row in report["pods"]}
    assert len(rows) == len(tasks), report["errors"]
    assert_expected_grades(rows)
    for task, row in rows.items():
        assert row["status"] == "ok" and row["graded_by"], (task, row["errors"])
    # The agent that searched its whole sandbox for the hidden tests found nothing.
    looked = rows["harbor-look-for-tests"]
    assert "hidden tests found: none" in looked["agent_output"], {
        k: looked.get(k) for k in ("agent_exit_code", "agent_output", "timing", "errors")
    }
    log = client.logs(batch.batch_id)
    if grade == "fresh":
        assert all('"mode": "grade"' in log[row["index"]] for row in rows.values())


@pytest.mark.k8s
@pytest.mark.k8s_real
def test_every_red_team_agent_earns_nothing_in_real_pods(real_node, real_stack, k8s_cluster):
    # The same agents on the real node, under both grade modes in one batch. It has hidden
    # tests and `fresh` tasks, so it grades apart: each agent runs in an init container that
    # never holds the tests, and the Pod's container grades after it (after the runner, the
    # agent container's PID 1, killed everything the agent left): `same` over the agent's
    # workspace, /tmp and /logs, `fresh` over the workspace alone.
    from trainer_stub.client import RolloutClient

    tasks = red_team_tasks("same")
    tasks += [task | {"id": f"fresh-{task['id']}"} for task in red_team_tasks("fresh")]
    client = RolloutClient(real_stack.redis_url)
    try:
        batch = client.submit(
            **real_node.batch_fields(),
            backend="kubernetes",
            tasks=tasks,
            samples_per_task=1,
            parallelism=4,
            policy=NEVER_ASKED,
            capacity_check="warn",
        )
        report = client.wait(batch.batch_id, timeout=900)
    finally:
        client.close()
    rows = {row["task_id"]: row for row in report["pods"]}
    assert len(rows) == len(tasks), report["errors"]
    assert_expected_grades({t: row for t, row in rows.items() if not t.startswith("fresh-")})
    assert_expected_grades({t[6:]: row for t, row in rows.items() if t.startswith("fresh-")})
    assert all(row["status"] == "ok" for row in rows.values())
    for prefix in ("", "fresh-"):
        found = rows[f"{prefix}harbor-look-for-tests"]["agent_output"]
        assert "hidden tests found: none" in found
