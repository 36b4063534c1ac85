"""Task env templates on Kubernetes (rollout_worker/backends/kube/task_env.py): the container
`env` entries that reference the batch namespace's copy of the user's Secret (optional only
where a default exists), each runner container getting the tables it hands on, the preflight
that names each missing key, and, until that copy is wired, a template refused by name by the
backend's preflight before anything is created."""

from __future__ import annotations

import copy

import pytest

from rollout_wire.errors import BackendError
from rollout_wire.request import parse_spec
from rollout_worker.backends.kube import pod_spec, task_env
from tests.unit.test_kube_backend import _backend, _Server

TASK = {"id": "t", "statement": "s", "files": {}, "test_command": ["bash", "/tests/test.sh"]}
ENV = {
    "environment": {"E": "${HOST_E}", "D": "${HOST_D:-x}", "L": "literal"},
    "verifier": {"V": "${HOST_V}"},
    "solution": {"S": "${HOST_S:-y}"},
}


def ref(var, optional):
    return {
        "name": f"ROLLOUT_TASKENV_{var}",
        "valueFrom": {
            "secretKeyRef": {"name": "rollout-task-env", "key": var, "optional": optional}
        },
    }


def test_the_container_names_match_pod_specs():
    assert task_env.AGENT_CONTAINER == pod_spec.AGENT_CONTAINER
    assert task_env.CONTAINER_NAME == pod_spec.CONTAINER_NAME


def test_each_var_is_a_secret_reference_optional_only_when_every_use_has_a_default():
    other = TASK | {"id": "u", "env": {"verifier": {"W": "${HOST_D}"}}}
    entries = task_env.container_env([TASK | {"env": ENV}, other])
    assert entries == [
        ref("HOST_D", False),  # task u uses it without a default
        ref("HOST_E", False),
        ref("HOST_S", True),
        ref("HOST_V", False),
    ]
    assert task_env.container_env([TASK]) == []
    assert "literal" not in str(entries)


def _pod(tasks, **fields):
    spec = parse_spec(
        {
            "count": 1,
            "parallelism": 1,
            "backend": "kubernetes",
            "tasks": tasks,
            "policy": {"url": "http://10.0.0.5:8000"},
            **fields,
        },
        max_episodes=None,
    )
    return spec, pod_spec.sandbox_pod_spec(spec, spec.image, [], 100)


def _names(container):
    return sorted(e["name"] for e in container["env"] if e["name"].startswith("ROLLOUT_TASKENV"))


def test_an_agent_container_never_gets_the_verifiers_keys_and_the_grader_gets_them():
    hidden = TASK | {"env": ENV, "tests": {"test.sh": "true"}}
    spec, pod = _pod([hidden])
    task_env.add_task_env(pod, spec.tasks)
    (agent,) = [c for c in pod["initContainers"] if c["name"] == "agent"]
    (grader,) = pod["containers"]
    assert _names(agent) == ["ROLLOUT_TASKENV_HOST_D", "ROLLOUT_TASKENV_HOST_E"]
    assert _names(grader) == [
        "ROLLOUT_TASKENV_HOST_D",
        "ROLLOUT_TASKENV_HOST_E",
        "ROLLOUT_TASKENV_HOST_V",
    ]
    # One container that acts and grades (no hidden tests) needs all it hands on.
    spec, pod = _pod([TASK | {"env": ENV, "agent": "oracle", "solution": {"solve.sh": "true"}}])
    task_env.add_task_env(pod, spec.tasks)
    assert "initContainers" not in pod
    assert _names(pod["containers"][0]) == [
        "ROLLOUT_TASKENV_HOST_D",
        "ROLLOUT_TASKENV_HOST_E",
        "ROLLOUT_TASKENV_HOST_S",
        "ROLLOUT_TASKENV_HOST_V",
    ]
    before = copy.deepcopy(pod := _pod([TASK])[1])
    task_env.add_task_env(pod, [TASK])
    assert pod == before


def test_preflight_names_each_missing_key_with_its_task():
    tasks = [TASK | {"env": ENV}]
    assert task_env.preflight_problems(tasks, "keys", {"HOST_E", "HOST_V"}) == []
    assert task_env.preflight_problems(tasks, "keys", {"HOST_E"}) == [
        "task 't': [verifier.env] V = ${HOST_V}: Secret 'keys' has no key of that name"
    ]
    assert task_env.preflight_problems(tasks, None, None) == [
        "task 't': [environment.env] E = ${HOST_E}: name a Secret holding it: "
        "--task-env-secret / task_env_secret",
        "task 't': [verifier.env] V = ${HOST_V}: name a Secret holding it: "
        "--task-env-secret / task_env_secret",
    ]
    assert task_env.preflight_problems(tasks, "gone", None) == [
        "task_env_secret 'gone': no such Secret in the workers' namespace"
    ]
    assert task_env.preflight_problems([TASK], None, None) == []


def test_the_batch_secret_holds_only_the_keys_the_tasks_use():
    source = {"HOST_E": "ZQ==", "HOST_V": "dg==", "UNRELATED": "dQ=="}
    secret = task_env.batch_secret([TASK | {"env": ENV}], source, "rollout-b1")
    assert secret is not None
    assert secret["metadata"] == {"name": "rollout-task-env", "namespace": "rollout-b1"}
    assert secret["data"] == {"HOST_E": "ZQ==", "HOST_V": "dg=="}
    assert task_env.batch_secret([TASK], source, "rollout-b1") is None


def test_the_kubernetes_preflight_refuses_a_template_by_name_before_any_call():
    server = _Server()
    backend = _backend(server)
    spec = parse_spec(
        {
            "batch_id": "b1",
            "count": 1,
            "parallelism": 1,
            "backend": "kubernetes",
            "tasks": [TASK | {"env": {"verifier": {"J": "${JUDGE_KEY:-m}"}}}],
            "policy": {"url": "http://10.0.0.5:8000"},
        },
        max_episodes=None,
    )
    with pytest.raises(BackendError) as refused:
        backend.preflight(spec)
    assert (
        "task 't': [verifier.env] J = ${JUDGE_KEY...}: ${VAR} templates are not resolved "
        "on Kubernetes yet" in str(refused.value)
    )
    assert server.calls == []
