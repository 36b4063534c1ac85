"""Their agent, their tasks, end to end on the local backend (real Redis, real workers, real
bubblewrap sandboxes): a third-party agent from PyPI (mini-swe-agent) and the example agent on
the official `openai` client (streaming) earn rewards from what ran, with every exchange
recorded; Harbor task folders run with their oracle and with an agent; an agent that rewrites
the tests or plants a reward earns nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.policy_server import running
from rollout_worker.cli.stack import LocalStack
from tests.integration import agents
from tests.integration.agents import MINI_ENV, mini_command
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / "tests" / "data" / "harbor"
# What a trainer sends with every call: the scripted server then returns token ids and
# log-probabilities, which the recording must keep.
SAMPLING = {"logprobs": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def agent_envs() -> dict[str, Path]:
    """The environments the real node's agent image is made of (tests/integration/agents.py):
    installed once a session, whichever test asks first."""
    return agents.agent_envs()


@pytest.fixture(scope="module")
def rootfs():
    """The Harbor image task's root filesystem, exported for the local backend (Docker); in a
    folder the sandboxes' host user can reach (pytest's own are closed to others)."""
    import shutil
    import sys
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="rollout-test-rootfs-"))
    folder.chmod(0o755)
    subprocess.run([str(ROOT / "hack" / "docker-up.sh")], check=True, timeout=900)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "tasks", "build", str(HARBOR)),
            *("--task", "image-task", "--rootfs", str(folder)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def agent_client(agent_envs, rootfs):
    allowed = ":".join(str(p) for p in agent_envs.values())
    env = {
        "ROLLOUT_AGENT_ENVS": allowed,
        "ROLLOUT_ROOTFS_DIR": str(rootfs),
        # The sandboxes' interpreter is the one the agent environments were made with.
        "ROLLOUT_LOCAL_PYTHON": agents.AGENT_PYTHON,
    }
    with LocalStack(collectors=2, extra_env=env) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        yield client
        client.close()


def steps_of(client, batch_id, index):
    return client.trajectory(batch_id, index)["steps"]


def test_mini_swe_agent_from_pypi_earns_the_scripted_rewards_with_every_exchange_recorded(
    agent_client, agent_envs
):
    tasks = load_task_set("bundled", ["shipping-boundary", "fizzbuzz-order", "inventory-two-bugs"])
    with running() as server:
        batch = agent_client.submit(
            tasks=tasks,
            samples_per_task=2,
            policy={"url": server.url, "sampling": SAMPLING},
            agent={"command": mini_command(agent_envs["mini"]), "env": MINI_ENV},
            agent_env=str(agent_envs["mini"]),
        )
        report = agent_client.wait(batch.batch_id, timeout=300)
        calls = server.calls()
    assert report["status"] == "succeeded", report["errors"]
    rewards = {(r["task_id"], r["sample"]): r["reward"] for r in report["pods"]}
    # What the scripted fixes do when mini-swe-agent runs them as shell commands.
    assert rewards == {
        ("shipping-boundary", 0): 1,
        ("shipping-boundary", 1): 1,
        ("fizzbuzz-order", 0): 1,
        ("fizzbuzz-order", 1): 0,  # the odd sample writes a wrong fix
        ("inventory-two-bugs", 0): 1,
        ("inventory-two-bugs", 1): 1,
    }
    for row in report["pods"]:
        assert row["agent_exit_code"] == 0 and row["stop_reason"] == "agent_exit"
        steps = steps_of(agent_client, batch.batch_id, row["index"])
        made = [c for c in calls if c["episode_id"] == row["pod"]]
        assert len(steps) == len(made) == row["steps"] >= 2  # every exchange, once
        for step in steps:
            assert step["status"] == 200 and step["stream"] is False
            assert step["request"]["tools"][0]["function"]["name"] == "bash"  # mini's own
            response = step["response"]
            assert step["tokens"]["prompt_ids"] and step["tokens"]["completion_ids"]
            assert response["choices"][0]["logprobs"]["content"]
        # Their agent's own conversation, as the engine saw it: ids for every turn.
        view = agent_client.tokens(batch.batch_id, row["index"])
        assert view is not None and view["tokens"] == "available", view
        turns = view["turns"] if view["layout"] == "sequence" else view["samples"]
        assert len(turns) == row["steps"]
        assert (
            steps[-1]["response"]["choices"][0]["message"]["tool_calls"][0]["function"][
                "arguments"
            ].find("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
            > 0
        )


def test_the_openai_client_agent_streams_and_each_stream_is_recorded_whole(
    agent_client, agent_envs
):
    env = agent_envs["openai"]
    tasks = load_task_set("bundled", ["shipping-boundary", "stack-pop"])
    with running() as server:
        batch = agent_client.submit(
            tasks=tasks,
            samples_per_task=1,
            policy={"url": server.url, "sampling": SAMPLING},
            agent={"command": [f"{env}/bin/python", f"{env}/openai_chat_agent.py"]},
            agent_env=str(env),
        )
        report = agent_client.wait(batch.batch_id, timeout=300)
    assert report["status"] == "succeeded", report["errors"]
    assert [r["reward"] for r in report["pods"]] == [1, 1]
    for row in report["pods"]:
        steps = steps_of(agent_client, batch.batch_id, row["index"])
        assert steps and all(s["stream"] is True and s["chunks"] >= 3 for s in steps)
        first = steps[0]["response"]
        call = first["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "bash" and "cat >" in call["function"]["arguments"]
        assert first["choices"][0]["logprobs"]["content"]  # kept from the chunks


def test_harbor_tasks_oracle_scores_one_and_an_agent_earns_what_its_tests_write(
    agent_client, agent_envs
):
    only = ["add-numbers", "partial-credit"]  # files-only environments
    # ...and one that is its image (a Dockerfile): the sandbox's root is the image's files.
    everything = [*only, "image-task"]
    oracle = agent_client.submit(tasks=load_task_set(str(HARBOR), everything), agent="oracle")
    report = agent_client.wait(oracle.batch_id, timeout=180)
    assert report["status"] == "succeeded", report["errors"]
    assert {r["task_id"]: r["reward"] for r in report["pods"]} == dict.fromkeys(everything, 1)
    details = {r["task_id"]: r["reward_details"] for r in report["pods"]}
    assert details["partial-credit"]["checks_passed"] == 4
    # An agent the scripted policy does not know these tasks for: it submits at once, and the
    # tests' own rewards are what is left: 0, and a fraction for partial credit.
    with running() as server:
        batch = agent_client.submit(
            tasks=load_task_set(str(HARBOR), only),
            policy={"url": server.url},
            agent={"command": mini_command(agent_envs["mini"]), "env": MINI_ENV},
            agent_env=str(agent_envs["mini"]),
        )
        report = agent_client.wait(batch.batch_id, timeout=300)
    assert report["status"] == "succeeded", report["errors"]
    assert {r["task_id"]: r["reward"] for r in report["pods"]} == {
        "add-numbers": 0,
        "partial-credit": 0.5,
    }


CHEAT = """
import os, pathlib
# What a reward-hacking agent tries: rewrite the tests it is graded by, plant the reward.
for folder in ("/tests", "/logs/verifier"):
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
fake = "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\\n"
pathlib.Path("/tests/test.sh").write_text(fake)
pathlib.Path("/logs/verifier/reward.txt").write_text("1\\n")
pathlib.Path("check_add.py").write_text("raise SystemExit(0)\\n")
"""


@pytest.mark.parametrize("grade", ["fresh", "same"])
def test_an_agent_that_rewrites_the_tests_earns_nothing(agent_client, grade):
    task = load_task_set(str(HARBOR), ["add-numbers"])[0] | {"grade": grade}
    assert "tests" in task and "test.sh" in task["tests"]
    batch = agent_client.submit(
        tasks=[task],
        samples_per_task=2,
        agent={"command": ["python", "-c", CHEAT]},
        policy={"url": "http://127.0.0.1:9"},  # never asked
    )
    report = agent_client.wait(batch.batch_id, timeout=180)
    assert report["status"] == "succeeded", report["errors"]
    for row in report["pods"]:
        assert row["agent_exit_code"] == 0 and row["reward"] == 0, row
    log = agent_client.logs(batch.batch_id)[0]
    assert '"mode": "grade"' in log  # graded in a second sandbox, given the real tests
