"""A task's env tables (Harbor's [environment.env], [verifier.env], [solution.env]): checked
as hostile input, carried as written, resolved only in the sandbox's runner from the values its
backend passes (never on a command line), each table shown only to the processes it is for."""

from __future__ import annotations

import json

import pytest

from rollout_wire import task_spec
from rollout_wire.errors import InvalidSpec
from rollout_wire.harbor import scan
from rollout_wire.request import parse_spec
from rollout_worker.backends.local import phases
from rollout_worker.backends.local.sandbox import plan_sandbox, secret_args
from tests.runner_program import episode
from tests.unit.test_agent_command import run_runner
from tests.unit.test_harbor import make_task

TASK = {
    "id": "t",
    "statement": "s",
    "files": {},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
}


def problems_of(env):
    found: list[str] = []
    task_spec.check_task_env(env, "env", found)
    return found


def test_names_values_and_templates_are_checked_as_hostile_input():
    assert problems_of({"environment": {"A": "x", "B": "${V}", "C": "${V:-d e}"}}) == []
    assert problems_of({"other": {}}) == [
        "env must be an object of tables ['environment', 'verifier', 'solution']"
    ]
    for name in ("OPENAI_API_KEY", "ROLLOUT_X", "PATH", "HOME", "OPENAI_BASE_URL"):
        assert "is set by the runner" in problems_of({"verifier": {name: "v"}})[0], name
    for name in ("1A", "A-B", "A B", "", "A" * 129):
        assert "is not a variable name" in problems_of({"verifier": {name: "v"}})[0], name
    assert "at most 4096" in problems_of({"solution": {"A": "x" * 4097}})[0]
    assert "at most 4096" in problems_of({"solution": {"A": 3}})[0]
    assert "at most 4096" in problems_of({"solution": {"A": "a\0b"}})[0]
    too_many = {f"V{i}": "x" for i in range(task_spec.MAX_TASK_ENV_VARS + 1)}
    assert "at most 64 names" in problems_of({"environment": too_many})[0]
    # Text around a template, or a broken one, is refused: never passed on unexpanded.
    for text in ("x${V}", "${V}y", "${1V}", "${V:default}", "${V"):
        assert "whole ${VAR}" in problems_of({"environment": {"A": text}})[0], text


def test_a_request_carries_the_templates_as_written_and_checks_them():
    env = {"environment": {"K": "${HOST_KEY}"}, "verifier": {"J": "${J:-x}"}}
    spec = parse_spec(
        {
            "count": 1,
            "parallelism": 1,
            "tasks": [TASK | {"env": env}],
            "policy": {"url": "http://10.0.0.5:8000"},
            "task_env_secret": "task-keys",
        },
        max_episodes=None,
    )
    assert spec.tasks[0]["env"] == env and spec.task_env_secret == "task-keys"
    with pytest.raises(InvalidSpec) as refused:
        parse_spec(
            {
                "count": 1,
                "parallelism": 1,
                "tasks": [TASK | {"env": {"environment": {"ROLLOUT_TASK_ID": "x"}}}],
                "task_env_secret": "Bad_Name",
            },
            max_episodes=None,
        )
    said = str(refused.value)
    assert "task 't': env.environment: 'ROLLOUT_TASK_ID' is set by the runner" in said
    assert "task_env_secret must be a Kubernetes Secret name" in said


def test_harbor_env_tables_map_onto_the_task_as_written(tmp_path):
    toml = (
        '[environment.env]\nK = "${OPENROUTER_API_KEY}"\n'
        '[verifier.env]\nJ = "${JUDGE:-gpt}"\n[solution.env]\nS = "plain"\n'
    )
    make_task(tmp_path, "t", toml=toml)
    (mapped,) = scan(tmp_path)
    assert mapped.task["env"] == {
        "environment": {"K": "${OPENROUTER_API_KEY}"},
        "verifier": {"J": "${JUDGE:-gpt}"},
        "solution": {"S": "plain"},
    }


def test_missing_vars_are_named_with_their_task_and_a_default_needs_none():
    tasks = [
        TASK | {"env": {"verifier": {"J": "${JUDGE}"}, "environment": {"D": "${DEF:-x}"}}},
        TASK | {"id": "u", "env": {"solution": {"S": "${SOL}"}}},
    ]
    assert task_spec.missing_task_env(tasks, lambda name: name == "SOL") == [
        "task 't': [verifier.env] J = ${JUDGE}: JUDGE is not set where the sandboxes start"
    ]
    assert task_spec.missing_task_env(tasks, lambda name: name in ("SOL", "JUDGE")) == []


def test_the_runner_and_the_wire_agree_on_the_template_and_the_prefix():
    assert episode.TASK_ENV_PREFIX == task_spec.TASK_ENV_PREFIX
    for text in ("${A}", "${A:-}", "${A:-x y}", "${A}b", "a${A}", "${1}", "plain"):
        ours = task_spec.env_template(text)
        match = episode.ENV_TEMPLATE.match(text)
        assert ours == (match.groups() if match else None), text


def test_the_runner_resolves_from_its_backends_values_and_takes_them_out_of_its_environment(
    monkeypatch,
):
    monkeypatch.setenv("ROLLOUT_TASKENV_HOST_KEY", "secret")
    monkeypatch.setenv("ROLLOUT_TASKENV_OTHER", "o")
    task = TASK | {
        "env": {
            "environment": {"K": "${HOST_KEY}", "D": "${ABSENT:-dflt}", "L": "lit"},
            "verifier": {"J": "${JUDGE}"},
        }
    }
    host = episode.take_host_values()
    assert host == {"HOST_KEY": "secret", "OTHER": "o"}
    assert not [name for name in __import__("os").environ if name.startswith("ROLLOUT_TASKENV_")]
    tables, missing = episode.resolve_task_env(task, host)
    assert tables == {"environment": {"K": "secret", "D": "dflt", "L": "lit"}, "verifier": {}}
    assert missing == ["[verifier.env] J = ${JUDGE}"]


SHOW_ENV = (
    "import json, os\n"
    "keys = ('SHOWN', 'JUDGE', 'HINT', 'ROLLOUT_TASKENV_HOST_SHOWN')\n"
    "print(json.dumps({k: os.environ.get(k) for k in keys}))\n"
)


def test_the_agent_sees_environment_env_and_the_tests_verifier_env_too(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(SHOW_ENV)
    test = tmp_path / "show.py"
    test.write_text(SHOW_ENV)
    task = TASK | {
        "agent": {"command": ["python", str(agent)]},
        "test_command": ["python", str(test)],
        "reward": "all",
        "baseline": False,
        "env": {
            "environment": {"SHOWN": "${HOST_SHOWN}"},
            "verifier": {"JUDGE": "${HOST_JUDGE:-judge-default}"},
            "solution": {"HINT": "h"},
        },
    }
    _, events = run_runner(
        tmp_path,
        task,
        url="http://127.0.0.1:9",
        extra_env={"ROLLOUT_TASKENV_HOST_SHOWN": "shown-value"},
    )
    exits = [e for e in events if e["event"] == "agent_exit"]
    assert exits, events
    agent_saw = json.loads(exits[0]["output_tail"].splitlines()[-1])
    assert agent_saw == {
        "SHOWN": "shown-value",
        "JUDGE": None,
        "HINT": None,
        "ROLLOUT_TASKENV_HOST_SHOWN": None,
    }
    (reward,) = [e for e in events if e["event"] == "reward"]
    tests_saw = json.loads(reward["tests_output"].strip().splitlines()[-1])
    assert tests_saw == {
        "SHOWN": "shown-value",
        "JUDGE": "judge-default",
        "HINT": None,
        "ROLLOUT_TASKENV_HOST_SHOWN": None,
    }


def test_a_var_without_value_ends_the_episode_as_infrastructure_before_anything_runs(tmp_path):
    task = TASK | {
        "agent": "oracle",
        "solution": {"solve.sh": "touch ran\n"},
        "env": {"environment": {"K": "${NOT_PASSED}"}},
    }
    _, events = run_runner(tmp_path, task)
    assert [e["event"] for e in events] == ["error"], events
    assert events[0]["kind"] == "infrastructure"
    assert "task 't': no value for [environment.env] K = ${NOT_PASSED}" in events[0]["cause"]
    assert not (tmp_path / "ws" / "ran").exists()


def test_bwrap_gets_the_values_through_a_file_descriptor_never_its_command_line(tmp_path):
    common = dict(
        python="/usr/bin/python3",
        python_prefix="/usr",
        program=tmp_path / "episode.py",
        workspace=tmp_path / "ws",
        episode_id="e",
        action="fix",
        running_as_root=False,
        secret_env={"ROLLOUT_TASKENV_K": "hush-value"},
    )
    plan = plan_sandbox(isolation="bwrap", **common)
    assert "hush-value" not in " ".join(plan.argv)
    argv = plan.argv_with_secrets(7)
    assert "hush-value" not in " ".join(argv)
    at = argv.index("--args")
    assert argv[at + 1] == "7" and argv[at + 2] == "--" and at > argv.index("--clearenv")
    assert secret_args(plan.secret_env) == b"--setenv\0ROLLOUT_TASKENV_K\0hush-value\0"
    fd = phases.secret_fd(plan)
    assert fd is not None
    import os

    try:
        assert os.read(fd, 1000) == secret_args(plan.secret_env)
    finally:
        os.close(fd)
    unsandboxed = plan_sandbox(isolation="none", **common)
    assert unsandboxed.env["ROLLOUT_TASKENV_K"] == "hush-value"
    assert "hush-value" not in " ".join(unsandboxed.argv)
    assert phases.secret_fd(unsandboxed) is None


def test_each_sandbox_gets_only_the_values_and_tables_its_processes_need():
    env = {
        "environment": {"E": "${HE}"},
        "verifier": {"V": "${HV}"},
        "solution": {"S": "${HS:-x}"},
    }
    host = {"HE": "e", "HV": "v", "HS": "s", "UNRELATED": "u"}
    hidden = TASK | {"env": env, "tests": {"test.sh": "true"}}
    assert phases.task_env_values(hidden, phases.AGENT_PHASE, host) == {"ROLLOUT_TASKENV_HE": "e"}
    assert phases.task_env_values(hidden | {"agent": "oracle"}, phases.AGENT_PHASE, host) == {
        "ROLLOUT_TASKENV_HE": "e",
        "ROLLOUT_TASKENV_HS": "s",
    }
    assert phases.task_env_values(hidden, phases.GRADE_PHASE, host) == {
        "ROLLOUT_TASKENV_HE": "e",
        "ROLLOUT_TASKENV_HV": "v",
    }
    # Tests in the agent's own sandbox (no grader's sandbox): it needs the verifier's too.
    assert "ROLLOUT_TASKENV_HV" in phases.task_env_values(TASK | {"env": env}, "agent", host)
    # The agent's tasks file holds no table it has no use for, literals included.
    assert phases.agent_task(hidden)["env"] == {"environment": {"E": "${HE}"}}
    oracle = phases.agent_task(hidden | {"agent": "oracle", "solution": {}})
    assert oracle["env"] == {"environment": {"E": "${HE}"}, "solution": {"S": "${HS:-x}"}}
    assert "env" not in phases.agent_task(hidden | {"env": {"verifier": {"V": "x"}}})
