"""The cost ledger end to end on the local backend (real Redis, real workers, real bubblewrap
sandboxes): what each episode used comes back on its row, measured inside its sandbox, and the
report adds it up."""

from __future__ import annotations

import pytest

from rollout_worker.cli.policy_server import running

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

BURN_SECONDS = 1.5  # CPU-seconds, whatever the machine's speed: the loop reads its own clock
BURN = (
    "import time\n"
    "start = time.process_time()\n"
    f"while time.process_time() - start < {BURN_SECONDS}:\n"
    "    sum(range(10000))  # arithmetic between clock reads (each one a system call)\n"
)
PASSING_TEST = (
    "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n\n\n"
    "if __name__ == '__main__':\n    unittest.main()\n"
)


def task(task_id: str) -> dict:
    return {
        "id": task_id,
        "statement": f"Task {task_id}.",
        "files": {"burn.py": BURN},
        "test_files": {"test_ok.py": PASSING_TEST},
        "test_command": ["python", "-B", "test_ok.py"],
        "baseline": False,
        "max_steps": 10,
    }


def run(command: str) -> dict:
    return {"tool": "run", "arguments": {"command": command}}


READ = {"tool": "read_file", "arguments": {"path": "burn.py"}}
SUBMIT = {"tool": "submit", "arguments": {}}
SCRIPT = {
    "tasks": {
        # The same wall time in its run turn, one spends it on the CPU, the other asleep.
        "burn": {"plans": [[run("python -B burn.py"), SUBMIT]]},
        "idle": {"plans": [[run(f"sleep {BURN_SECONDS}"), SUBMIT]]},
        # A longer conversation: every turn sends the growing history again.
        "chatty": {"plans": [[READ, READ, READ, READ, READ, SUBMIT]]},
    }
}


def test_each_row_carries_what_its_episode_used_and_the_report_adds_it_up(client):
    with running(script=SCRIPT) as server:
        batch = client.submit(
            tasks=[task("burn"), task("idle"), task("chatty")],
            parallelism=3,
            policy={"url": server.url},
        )
        report = client.wait(batch.batch_id, timeout=180)
    assert report["status"] == "succeeded", report["errors"]
    assert report["run_isolation"] == "bwrap"
    rows = {r["task_id"]: r for r in report["pods"]}
    costs = {name: row["cost"] for name, row in rows.items()}
    for name, cost in costs.items():
        # Every process of the sandbox's own PID namespace, read from its /proc.
        assert cost["cpu_source"] == "proc", name
        assert cost["cpu_seconds"] > 0 and cost["peak_memory_bytes"] > 2**20, name
        # The ledger's own reading stays within 2% of what the episode used.
        assert cost["ledger_cpu_seconds"] <= 0.02 * cost["cpu_seconds"], (name, cost)
        assert cost["policy_turns"] == rows[name]["steps"], name
        steps = client.trajectory(batch.batch_id, rows[name]["index"])["steps"]
        assert cost["prompt_tokens"] == sum(s["response"]["usage"]["prompt_tokens"] for s in steps)
        assert cost["completion_tokens"] == sum(
            s["response"]["usage"]["completion_tokens"] for s in steps
        )
        assert cost["wall"]["start"] > 0 and cost["wall"]["tests"] > 0, name

    # The burner's CPU is its loop's on top of what the idle episode used.
    assert costs["burn"]["cpu_seconds"] >= costs["idle"]["cpu_seconds"] + 0.8 * BURN_SECONDS
    assert costs["burn"]["cpu_user_seconds"] >= BURN_SECONDS * 0.8
    # Both spent the same wall time in their agent turns; only one of them on the CPU.
    assert costs["idle"]["wall"]["agent"] >= BURN_SECONDS
    assert costs["idle"]["cpu_seconds"] < 0.5 * costs["idle"]["wall"]["agent"]
    # Six turns, each resending the conversation, against two.
    assert costs["chatty"]["policy_turns"] == 6 and costs["idle"]["policy_turns"] == 2
    assert costs["chatty"]["prompt_tokens"] > 3 * costs["idle"]["prompt_tokens"]
    assert costs["chatty"]["completion_tokens"] > costs["idle"]["completion_tokens"]

    total = report["cost"]
    assert total["ledgers"] == 3
    assert total["cpu_seconds"] == pytest.approx(sum(c["cpu_seconds"] for c in costs.values()))
    assert total["prompt_tokens"] == sum(c["prompt_tokens"] for c in costs.values())
    assert total["peak_memory_bytes"] == max(c["peak_memory_bytes"] for c in costs.values())
    assert report["reward_sum"] == 3
    assert total["cpu_seconds_per_reward"] == pytest.approx(total["cpu_seconds"] / 3)
    groups = {g["task_id"]: g["cost"] for g in report["groups"]}
    assert groups["burn"]["cpu_seconds"] == pytest.approx(costs["burn"]["cpu_seconds"])
    # Three slots, each busy from its sandbox's ready to its end, never more than the wall.
    assert 0 < report["slot_utilisation"] <= 1
