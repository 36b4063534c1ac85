"""`isolation` (issue 46): "pod" (a Pod per episode) or "host" (sandboxes in sandbox-host
Pods), only on Kubernetes; what a host batch is allowed that a Pod batch is not; which backend
runs it; the `--isolation` option; the report's request section."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import parse_spec
from rollout_worker.backends import backend_name
from rollout_worker.backends.host.run import LEASE_LOST
from rollout_worker.cli import placement
from rollout_worker.report import _request_section
from rollout_worker.validation import INFRASTRUCTURE_REASONS
from tests.unit.test_task_steps import TASK


def spec(**fields: Any):
    sizes = {} if "tasks" in fields else {"count": 2, "parallelism": 1}
    return parse_spec({**sizes, **fields}, max_episodes=None)


def problems(**fields: Any) -> str:
    with pytest.raises(InvalidSpec) as info:
        spec(**fields)
    return " | ".join(info.value.problems)


def test_isolation_defaults_to_pod_and_host_goes_with_kubernetes_only():
    assert spec().isolation == "pod" and spec(backend="kubernetes").isolation == "pod"
    assert spec(backend="kubernetes", isolation="host").isolation == "host"
    assert "isolation: host is for backend kubernetes" in problems(isolation="host")
    assert "isolation 'vm' is not one of ['pod', 'host']" in problems(
        backend="kubernetes", isolation="vm"
    )


def test_a_host_batch_runs_local_semantics_where_a_pod_batch_may_not():
    own_image_steps = {
        "tasks": [TASK | {"image": "rollout.local/t:1"}],
        "policy": {"url": "http://10.0.0.1:8000/v1"},
    }
    assert "in their own image" in problems(backend="kubernetes", **own_image_steps)
    host = spec(backend="kubernetes", isolation="host", **own_image_steps)
    assert host.tasks[0]["steps"] == TASK["steps"]
    assert "agent_env is for the local backend" in problems(backend="kubernetes", agent_env="/v")
    # Allowed by the request; the host backend's preflight refuses it (no per-batch secrets
    # or folders on a shared host in slice 1).
    assert spec(backend="kubernetes", isolation="host", agent_env="/v").agent_env == "/v"


def test_the_policy_of_a_host_batch_is_still_an_ip_address():
    policy = {"url": "http://policy.example:8000/v1"}
    found = problems(backend="kubernetes", isolation="host", tasks=[TASK], policy=policy)
    assert "must be an IP address on kubernetes" in found


def test_backend_name_sends_a_host_batch_to_the_hosts_backend():
    assert backend_name(spec()) == "local"
    assert backend_name(spec(backend="kubernetes")) == "kubernetes"
    assert backend_name(spec(backend="kubernetes", isolation="host")) == "hosts"


def test_the_isolation_option_reaches_the_batch_fields():
    seen: list[dict[str, Any]] = []

    @click.command()
    @placement.options
    def command(placement: dict[str, Any]) -> None:
        seen.append(placement)

    runner = CliRunner()
    assert runner.invoke(command, []).exit_code == 0
    assert runner.invoke(command, ["--isolation", "host"]).exit_code == 0
    assert [s["isolation"] for s in seen] == ["pod", "host"]
    bad = runner.invoke(command, ["--isolation", "vm"])
    assert bad.exit_code == 2 and "'vm' is not one of 'pod', 'host'" in bad.output


def test_the_report_says_what_isolation_ran_and_host_lost_is_infrastructure():
    assert _request_section(spec(backend="kubernetes", isolation="host"))["isolation"] == "host"
    assert _request_section(spec())["isolation"] == "pod"
    assert "HostLost" in INFRASTRUCTURE_REASONS
    assert LEASE_LOST in INFRASTRUCTURE_REASONS  # a host's lost lease, were one ever recorded
