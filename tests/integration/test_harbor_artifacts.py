"""Harbor's `artifacts` end to end on the local backend (real Redis, workers and bubblewrap
sandboxes): `rollout run --tasks DIR --agent oracle --all-in-one --output DIR`. What the task
lists is read from the grader's sandbox after the tests into the reward event, so into the
episode's log in the records; a link the oracle planted to a host file is refused by name,
never followed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.test_harbor import make_task

pytestmark = [pytest.mark.redis, pytest.mark.workers]

TEST = "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
SOLVE = """#!/bin/bash
mkdir -p /logs/agent
echo "trajectory of the oracle" > /logs/agent/trajectory.txt
printf '\\x00\\x01binary' > result.bin
ln -s /etc/hostname /logs/agent/host-file
"""


def test_listed_files_reach_the_records_and_a_planted_link_is_refused(tmp_path):
    tasks = tmp_path / "tasks"
    make_task(
        tasks,
        "keeps-artifacts",
        toml='artifacts = ["/logs/agent", "result.bin", "/logs/none.txt"]\n'
        "[agent]\ntimeout_sec = 20\n",
        tests={"test.sh": TEST},
        solution={"solve.sh": SOLVE},
    )
    records = tmp_path / "records"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", "oracle", "--json", "--all-in-one", "--output", str(records)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    (log,) = records.glob("rollout-*-0.log")
    rewards = [
        json.loads(line) for line in log.read_text().splitlines() if '"event": "reward"' in line
    ]
    assert len(rewards) == 1, log.read_text()[-2000:]
    reward = rewards[0]
    kept = {a["path"]: a for a in reward["artifacts"]}
    assert kept["/logs/agent/trajectory.txt"]["text"] == "trajectory of the oracle\n"
    assert kept["result.bin"]["base64"] == "AAFiaW5hcnk="
    assert reward["artifacts_refused"] == [
        "/logs/agent/host-file: a symbolic link (never followed)",
        "/logs/none.txt: No such file or directory",
    ]
    # The refusals reach the row and the report, not only the log.
    report = json.loads((records / "results.json").read_text())
    assert report["pods"][0]["artifacts_refused"] == reward["artifacts_refused"]
    assert report["artifacts_refused_episodes"] == 1
    assert any("had artifacts refused" in w for w in report["warnings"]), report["warnings"]
