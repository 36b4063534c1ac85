"""Fixtures of the chart tests: a pinned helm (hack/helm.sh builds it from the Go module proxy
once), the chart's path, and `render` (helm template -> list of objects)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "chart"
HELM_BUILD_TIMEOUT = 1800


@pytest.fixture(scope="session")
def helm() -> str:
    """The pinned helm binary (built on first use; a build failure fails the tests)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "hack" / "helm.sh"), "--path"],
        capture_output=True,
        text=True,
        timeout=HELM_BUILD_TIMEOUT,
    )
    if proc.returncode != 0:
        pytest.fail(f"hack/helm.sh could not build helm:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip()


def run_helm(helm: str, *args: str, timeout: float = 600, check: bool = True, **kw):
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"helm {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def render(helm):
    """helm template with --set values -> the rendered objects (test hooks included)."""

    def _render(*sets: str, namespace: str = "rollout") -> list[dict]:
        args = ["template", "rel", str(CHART), "--namespace", namespace]
        for item in sets:
            args += ["--set", item]
        out = run_helm(helm, *args).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return _render
