"""The import arrows of the layers: what each kind of process loads."""

from __future__ import annotations

import subprocess
import sys

import pytest


def loaded(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {name.split(".")[0] for name in out.split()}


def test_the_trainer_side_loads_no_worker_and_no_kubernetes():
    modules = loaded("from trainer_stub import submit_batch, RolloutClient")
    assert not modules & {"rollout_worker", "kubernetes", "matplotlib"}


def test_the_wire_package_loads_nothing_of_either_side():
    modules = loaded(
        "import rollout_wire.codec, rollout_wire.request, rollout_wire.rows, rollout_wire.errors"
    )
    assert not modules & {"rollout_worker", "trainer_stub", "celery", "redis", "kubernetes"}


@pytest.mark.parametrize(
    "entry",
    [
        # What `rollout worker` runs before Celery takes over, and the tasks it registers.
        "from rollout_worker.cli.main import cli\n"
        "from rollout_worker.celery_app import create_app\n"
        "from rollout_worker.settings import Settings; create_app(Settings())",
        # The local supervisor process.
        "import rollout_worker.backends.local.supervisor",
    ],
)
def test_worker_processes_load_no_plotting_or_terminal_library(entry):
    assert not loaded(entry) & {"matplotlib", "rich", "trainer_stub"}


def test_the_local_supervisor_loads_no_kubernetes_client():
    assert "kubernetes" not in loaded("import rollout_worker.backends.local.supervisor")
