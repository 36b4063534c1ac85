"""The compose file and its documentation agree with the code (no Docker needed)."""

from __future__ import annotations

import re
import subprocess
import sys

import yaml

from rollout_worker.settings import SETTINGS_DOC
from tests.compose.conftest import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
WORKERS = ("control", "collect")


def test_every_setting_reaches_the_containers_through_one_anchor():
    assert list(COMPOSE["x-rollout-env"]) and set(COMPOSE["x-rollout-env"]) == set(SETTINGS_DOC)
    for name in (*WORKERS, "flower", "trainer"):
        env = SERVICES[name]["environment"]
        assert set(SETTINGS_DOC) <= set(env), name
        assert env["ROLLOUT_REDIS_URL"] == "redis://redis:6379/0"


def test_the_settings_table_in_docker_readme_is_generated_and_current():
    done = subprocess.run(
        [sys.executable, "docker/env_doc.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_every_compose_variable_is_documented():
    text = (ROOT / "docker-compose.yml").read_text()
    readme = (ROOT / "docker" / "README.md").read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    assert used, "the compose file reads no variables?"
    assert sorted(v for v in used if f"`{v}`" not in readme) == []


def test_workers_reap_share_the_runs_volume_and_report_health():
    root = COMPOSE["x-rollout-env"]["ROLLOUT_LOCAL_ROOT"]
    for name in WORKERS:
        service = SERVICES[name]
        assert service["init"] is True, name
        assert "--events" in service["command"], name
        mounts = [v.split(":")[:2] for v in service["volumes"]]
        volume_mounts = [(src, dst) for src, dst in mounts if src == "runs"]
        assert len(volume_mounts) == 1 and root.startswith(volume_mounts[0][1] + "/"), name
        assert "inspect ping" in " ".join(service["healthcheck"]["test"]), name
    # Scalable: nothing a second replica would clash on.
    assert "container_name" not in SERVICES["collect"] and "ports" not in SERVICES["collect"]
    assert "--pool threads" in SERVICES["collect"]["command"]


def test_redis_persists_and_the_trainer_is_one_shot():
    redis = SERVICES["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    trainer = SERVICES["trainer"]
    assert trainer["profiles"] == ["trainer"] and trainer["restart"] == "no"
    # `compose run` of a service with depends_on would scale the collectors back to one.
    assert "depends_on" not in trainer


def test_only_the_control_worker_is_unconfined_for_bubblewrap():
    assert set(SERVICES["control"]["security_opt"]) == {
        "seccomp=unconfined",
        "systempaths=unconfined",
    }
    for name in ("collect", "redis", "flower", "trainer"):
        assert "security_opt" not in SERVICES[name], name
        assert not SERVICES[name].get("privileged"), name
