"""Task env templates on Kubernetes (rollout_worker/backends/kube/task_env.py): the container
`env` entries that reference the batch namespace's copy of the user's Secret (optional only
where a default exists), each runner container getting the tables it hands on, the preflight
that reads the user's Secret and names each missing key before anything is created, the
batch namespace's labelled copy of the keys used (made after the namespace's UID is recorded),
cold starts, and the agent's tasks file without the tables its runner does not hand it."""

from __future__ import annotations

import copy

import orjson
import pytest
from kubernetes.client.rest import ApiException

from rollout_wire.errors import BackendError
from rollout_wire.request import parse_spec
from rollout_wire.tasksets import agent_task
from rollout_worker.backends.kube import api, objects, pod_spec, task_env
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
    _, pod = _pod([hidden])  # sandbox_pod_spec adds them to a cold Pod
    (agent,) = [c for c in pod["initContainers"] if c["name"] == "agent"]
    (grader,) = pod["containers"]
    assert _names(agent) == ["ROLLOUT_TASKENV_HOST_D", "ROLLOUT_TASKENV_HOST_E"]
    assert _names(grader) == [
        "ROLLOUT_TASKENV_HOST_D",
        "ROLLOUT_TASKENV_HOST_E",
        "ROLLOUT_TASKENV_HOST_V",
    ]
    # One container that acts and grades (no hidden tests) needs all it hands on.
    _, pod = _pod([TASK | {"env": ENV, "agent": "oracle", "solution": {"solve.sh": "true"}}])
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


class _SecretServer(_Server):
    """The fake API server, holding the user's Secret `keys` in the workers' namespace."""

    def __init__(self, data):
        super().__init__()
        self.data = data
        self.full = []  # every call with all its arguments (bodies included)

    def answer(self, method, args, kwargs):
        self.full.append((method, args))
        if method == "read_namespaced_secret":
            if self.data is None:
                raise ApiException(status=404, reason="Not Found")
            assert args == ("keys", "workers")
            return {"metadata": {"name": "keys"}, "data": self.data}
        return super().answer(method, args, kwargs)


def _env_spec(env, **fields):
    request = {
        "batch_id": "b1",
        "count": 1,
        "parallelism": 1,
        "backend": "kubernetes",
        "tasks": [TASK | {"env": env, "tests": {"test.sh": "true"}}],
        "policy": {"url": "http://10.0.0.5:8000"},
        "task_env_secret": "keys",
        "capacity_check": "off",
    }
    return parse_spec(request | fields, max_episodes=None)


@pytest.fixture
def workers_ns(monkeypatch):
    monkeypatch.setattr(api, "workers_namespace", lambda settings: "workers")


def test_the_kubernetes_preflight_refuses_a_missing_key_by_name_before_anything_is_made(
    workers_ns,
):
    server = _SecretServer({"HOST_E": "ZQ=="})
    with pytest.raises(BackendError) as refused:
        _backend(server).preflight(_env_spec(ENV))
    assert str(refused.value) == (
        "task 't': [verifier.env] V = ${HOST_V}: Secret 'keys' has no key of that name "
        "(workers' namespace 'workers')"
    )
    assert server.calls == [("read_namespaced_secret", ("keys", "workers"))]
    # start_run refuses it too (the Secret may change after the preflight), still before
    # any object is created.
    with pytest.raises(BackendError):
        _backend(server).start_run(_env_spec(ENV), lambda _: None)
    assert not [m for m, _ in server.calls if m.startswith("create")]
    gone = _SecretServer(None)
    with pytest.raises(BackendError, match="'keys': no such Secret"):
        _backend(gone).preflight(_env_spec(ENV))


def test_a_batch_without_templates_reads_no_secret(workers_ns):
    server = _SecretServer(None)
    _backend(server).preflight(_env_spec({"environment": {"L": "literal"}}))
    _backend(server).start_run(_env_spec({"environment": {"L": "literal"}}), lambda _: None)
    assert not [m for m, _ in server.calls if "secret" in m]


def test_a_run_copies_the_keys_it_uses_into_its_namespace_after_the_receipt(workers_ns):
    server, records = _SecretServer({"HOST_E": "ZQ==", "HOST_V": "dg==", "OTHER": "bw=="}), []
    spec = _env_spec(ENV)
    _backend(server).preflight(spec)
    _backend(server).start_run(spec, records.append)
    created = [m for m, _ in server.calls if m.startswith("create")]
    assert created[:2] == ["create_namespace", "create_namespaced_secret"]
    assert records[0]["namespace"] == "rollout-b1" and {"uid": "uid-1"} in records
    (secret,) = [a[-1] for m, a in _created(server) if m == "create_namespaced_secret"]
    assert secret["metadata"] == {
        "name": "rollout-task-env",
        "namespace": "rollout-b1",
        "labels": {"rollout.dev/owner": "rollout", "rollout.dev/batch": "b1"},
    }
    assert secret["data"] == {"HOST_E": "ZQ==", "HOST_V": "dg=="}
    # No value in any other object: the Pods reference the copy, the ConfigMap holds the text.
    others = str([a for m, a in _created(server) if m != "create_namespaced_secret"])
    assert "ZQ==" not in others and "dg==" not in others and "rollout-task-env" in others
    assert str(records).count("ZQ==") == 0


def _created(server):
    return [(m, a) for m, a in server.full if m.startswith("create")]


def test_a_batch_with_env_tables_takes_no_warm_pod_and_others_keep_their_keys():
    backend = _backend(_Server())
    literal = TASK | {"env": {"environment": {"L": "literal"}}}
    assert backend.pool_key(_env_spec({}, tasks=[literal])) is None
    assert backend.pool_key(_env_spec({}, tasks=[TASK])) is not None
    # A warm Pod holds no Secret reference: its task comes later.
    spec = _env_spec(ENV, tasks=[TASK | {"env": ENV}])
    warm = pod_spec.sandbox_pod_spec(spec, spec.image, [], 100, warm=True)
    assert "ROLLOUT_TASKENV" not in str(warm)
    cold = pod_spec.sandbox_pod_spec(spec, spec.image, [], 100)
    assert "ROLLOUT_TASKENV_HOST_E" in str(cold)


def test_the_agents_tasks_file_holds_only_the_tables_its_runner_hands_it():
    hidden = TASK | {"env": ENV, "tests": {"test.sh": "true"}}
    assert agent_task(hidden)["env"] == {"environment": ENV["environment"]}
    oracle = agent_task(hidden | {"agent": "oracle", "solution": {}})
    assert oracle["env"] == {"environment": ENV["environment"], "solution": ENV["solution"]}
    assert "env" not in agent_task(hidden | {"env": {"verifier": {"V": "x"}}})
    assert agent_task(TASK) == TASK
    spec = _env_spec(ENV)
    data = objects.configmap_manifest(spec, "PROGRAM")["data"]
    (agent,) = orjson.loads(data[pod_spec.AGENT_TASKS_KEY])
    assert agent["env"] == {"environment": ENV["environment"]}
    assert "HOST_V" not in data[pod_spec.AGENT_TASKS_KEY]


def test_a_container_that_acts_and_grades_reads_only_its_agents_tables():
    # No hidden tests: one container; a non-oracle agent there never reads [solution.env].
    task = TASK | {"env": ENV, "solution": {"solve.sh": "true"}}
    spec = _env_spec(ENV, tasks=[task])
    pod = pod_spec.sandbox_pod_spec(spec, spec.image, [], 100)
    assert "initContainers" not in pod
    (program,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/demo"]
    assert program["name"] == "agent-program"
    data = objects.configmap_manifest(spec, "PROGRAM")["data"]
    (agent,) = orjson.loads(data[pod_spec.AGENT_TASKS_KEY])
    assert agent["env"] == {"environment": ENV["environment"], "verifier": ENV["verifier"]}
    assert "solution" not in agent
    # Without env tables the same batch keeps today's Pod and ConfigMap.
    plain = _env_spec({}, tasks=[TASK | {"solution": {"solve.sh": "true"}}])
    assert pod_spec.AGENT_TASKS_KEY not in objects.configmap_manifest(plain, "P")["data"]
    assert "agent-program" not in str(pod_spec.sandbox_pod_spec(plain, plain.image, [], 100))
