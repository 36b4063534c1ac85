"""`grade: fresh` (Harbor `environment_mode = "separate"`) for a task in its own image, on the
local cluster's real node: a seed container of the image copies its workdir into the Pod's
workspace volume, the agent's container works there, and a fresh container of the image
grades with only that workspace. The red team runs there too: every trick earns 0, the honest
fixes 1, and the agent that searches its whole container for the hidden tests finds none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout_wire.tasksets import load_task_set
from tests.integration.test_red_team import NEVER_ASKED, assert_expected_grades, red_team_tasks
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

ROOT = Path(__file__).resolve().parents[2]
TASK_TOML = """version = "1.0"

[agent]
timeout_sec = 40

[verifier]
timeout_sec = 20
environment_mode = "separate"

[environment]
workdir = "/app"
"""
DOCKERFILE = """FROM rollout.local/python:3-bookworm
WORKDIR /app
COPY greet.py /app/greet.py
RUN mkdir -p /app/pkg /outside && echo "VERSION = 1" > /app/pkg/version.py \\
    && ln -s pkg/version.py /app/version-link && echo pristine > /outside/state \\
    && chmod -R a+rwX /app /outside
"""
# The oracle fixes greet.py and changes what a shared grader would see: a file of the image's
# root outside the workspace, /tmp, /logs, and a daemon that would undo the fix later.
SOLVE = """#!/bin/bash
cat > /app/greet.py <<'PY'
def greeting(name):
    return f"Hello, {name}!"
PY
echo tampered > /outside/state
touch /tmp/left-by-the-agent
mkdir -p /logs/verifier && echo 1 > /logs/verifier/planted
(sleep 3; echo 'def greeting(name): return name' > /app/greet.py) &
disown
exit 0
"""
# Every check is a detail of the reward, so a failure says which one.
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
python3 -B - <<'PY'
import json, os, sys
sys.path.insert(0, "/app")
checks = {}
try:
    from greet import greeting
    checks["fixed"] = float(greeting("Ada") == "Hello, Ada!")
except Exception:
    checks["fixed"] = 0.0
checks["in_workdir"] = float(os.getcwd() == "/app")
checks["seeded"] = float(open("/app/pkg/version.py").read() == "VERSION = 1\\n")
checks["link_kept"] = float(os.readlink("/app/version-link") == "pkg/version.py")
checks["fresh_root"] = float(open("/outside/state").read() == "pristine\\n")
checks["fresh_tmp"] = float(not os.path.exists("/tmp/left-by-the-agent"))
checks["fresh_logs"] = float(not os.path.exists("/logs/verifier/planted"))
checks["reward"] = float(all(v == 1.0 for v in checks.values()))
json.dump(checks, open("/logs/verifier/reward.json", "w"))
PY
"""


def write_task(folder: Path) -> None:
    files = {
        "task.toml": TASK_TOML,
        "instruction.md": "`greeting(name)` in `/app/greet.py` should return `Hello, <name>!`.\n",
        "environment/Dockerfile": DOCKERFILE,
        "environment/greet.py": 'def greeting(name):\n    return "Hello " + name\n',
        "solution/solve.sh": SOLVE,
        "tests/test.sh": TEST_SH,
    }
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_fresh_grading_of_a_task_in_its_own_image_on_the_real_node(real_node, real_stack, tmp_path):
    harbor = tmp_path / "harbor"
    write_task(harbor / "own-fresh")
    subprocess.run(["hack/docker-up.sh"], check=True, cwd=ROOT, timeout=600)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "tasks", "build", str(harbor)),
            *("--task", "own-fresh", "--node-import"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (own,) = load_task_set(str(harbor))
    assert (own["grade"], own["workdir"]) == ("fresh", "/app") and own["image"]
    # The red team in the same image and workdir, graded fresh: each task's files are written
    # into the seeded workspace, its hidden tests reach only the grader.
    tricks = [t | {"image": own["image"], "workdir": "/app"} for t in red_team_tasks("fresh")]
    # A workdir the image does not have: the seed fails the episode, saying so (its own Job).
    missing = own | {"id": "no-workdir", "workdir": "/no-such-folder", "agent": "oracle"}
    tasks = [own | {"agent": "oracle"}, missing, *tricks]
    client = RolloutClient(real_stack.redis_url)
    try:
        batch = client.submit(
            **real_node.batch_fields(),
            backend="kubernetes",
            tasks=tasks,
            samples_per_task=1,
            parallelism=4,
            # The Job's podFailurePolicy then names the seed's container too (the API server
            # checks it); the seed's episode error is not retried.
            infra_retries=1,
            policy=NEVER_ASKED,
            capacity_check="warn",
        )
        report = client.wait(batch.batch_id, timeout=900)
        logs = client.logs(batch.batch_id)
    finally:
        client.close()
    rows = {row["task_id"]: row for row in report["pods"]}
    assert len(rows) == len(tasks), report["errors"]
    oracle = rows["own-fresh"]
    assert oracle["reward"] == 1, (
        oracle["reward_details"],
        oracle["errors"],
        oracle["tests_output"],
    )
    assert oracle["status"] == "ok" and oracle["grade_cause"] is None
    lost = rows.pop("no-workdir")
    assert (lost["reward"], lost["status"], lost["failure_kind"]) == (0, "failed", "episode"), lost
    assert "'/no-such-folder' is not a folder" in lost["failure_cause"], lost
    assert_expected_grades({t: row for t, row in rows.items() if t != "own-fresh"})
    assert all(row["status"] == "ok" for row in rows.values())
    found = rows["harbor-look-for-tests"]["agent_output"]
    assert "hidden tests found: none" in found, found
    # Each episode: the agent's part ended with grade_pending, a second runner graded.
    assert all('"mode": "grade"' in logs[row["index"]] for row in rows.values())
