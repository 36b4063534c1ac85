"""Every key of Harbor's task.toml schema is honoured (mapped onto the task, or onto the
batch's limits) or refused by name; a key not in the schema is refused naming it and its
file, unless --allow-unknown-keys makes it a warning. Also the limits that follow the tasks
(`rollout run --tasks`) and where each backend puts a task's workdir."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_wire.errors import InvalidSpec, TaskWarning
from rollout_wire.harbor import KNOWN_KEYS, scan
from rollout_wire.request import (
    DEFAULT_DEADLINE_SECONDS,
    DEFAULT_EPISODE_TIMEOUT_SECONDS,
    MAX_DEADLINE_SECONDS,
    parse_spec,
)
from rollout_wire.tasksets import (
    DEADLINE_MARGIN_SECONDS,
    SETUP_MARGIN_SECONDS,
    episode_seconds,
    load_task_set,
    task_limits,
)
from tests.unit.test_harbor import make_task

# One value per key of the schema, and what it must do: ("task", field, value) a task field,
# ("requires", name, value) a batch limit, ("warns", text) accepted with a warning,
# ("refused", text) refused by name, ("described", None) carried into the description or
# ignored by design (purely descriptive).
EVERY_KEY: dict[str, tuple[str, Any]] = {
    "schema_version": ('schema_version = "1.1"', ("described", None)),
    "version": ('version = "1.0"', ("described", None)),
    "source": ('source = "https://example.com/set"', ("described", None)),
    "artifacts": ('artifacts = ["/logs/out.txt"]', ("task", "artifacts", ["/logs/out.txt"])),
    # Honoured (test_harbor_steps.py): a step needs its steps/<name>/ folder, and the
    # strategy its steps.
    "steps": ('[[steps]]\nname = "one"', ("refused", "no steps/one")),
    "multi_step_reward_strategy": (
        'multi_step_reward_strategy = "mean"',
        ("refused", "multi_step_reward_strategy without [[steps]]"),
    ),
    "metadata": ('[metadata]\ndifficulty = "easy"\nanything = 1', ("described", None)),
    "task.name": ('[task]\nname = "org/name"', ("described", None)),
    "task.version": ('[task]\nversion = "2"', ("described", None)),
    "task.description": ('[task]\ndescription = "Adds."', ("described", None)),
    "task.authors": ('[[task.authors]]\nname = "A"', ("described", None)),
    "task.keywords": ('[task]\nkeywords = ["x"]', ("described", None)),
    "agent.timeout_sec": ("[agent]\ntimeout_sec = 90.5", ("task", "time_limit_seconds", 91)),
    "agent.user": ("[agent]\nuser = 1000", ("task", "id", "t")),
    "agent.network_mode": ('[agent]\nnetwork_mode = "no-network"', ("task", "id", "t")),
    "agent.allowed_hosts": ('[agent]\nallowed_hosts = ["pypi.org"]', ("refused", "allowed_hosts")),
    "verifier.timeout_sec": ("[verifier]\ntimeout_sec = 7", ("task", "test_timeout_seconds", 7)),
    "verifier.env": ('[verifier]\nenv = { K = "v" }', ("task", "env", {"verifier": {"K": "v"}})),
    "verifier.user": ('[verifier]\nuser = "root"', ("refused", "never run as root")),
    "verifier.network_mode": ('[verifier]\nnetwork_mode = "public"', ("refused", "no network")),
    "verifier.allowed_hosts": ("[verifier]\nallowed_hosts = []", ("task", "id", "t")),
    "verifier.environment_mode": (
        '[verifier]\nenvironment_mode = "separate"',
        ("task", "grade", "fresh"),
    ),
    "verifier.environment": (
        "[verifier.environment]\ncpus = 1",
        ("refused", "[verifier] environment in"),
    ),
    "environment.build_timeout_sec": (
        "[environment]\nbuild_timeout_sec = 600",
        ("warns", "build_timeout_sec = 600 not enforced"),
    ),
    "environment.docker_image": (
        '[environment]\ndocker_image = "registry.example.com/x:1"',
        ("task", "image", "registry.example.com/x:1"),
    ),
    "environment.cpus": ("[environment]\ncpus = 2", ("requires", "cpus", 2)),
    "environment.memory_mb": ("[environment]\nmemory_mb = 1024", ("requires", "memory_mb", 1024)),
    "environment.storage_mb": (
        "[environment]\nstorage_mb = 10240",
        ("requires", "storage_mb", 10240),
    ),
    "environment.gpus": ("[environment]\ngpus = 1", ("refused", "GPUs are not supported")),
    "environment.gpu_types": ('[environment]\ngpu_types = ["H100"]', ("refused", "gpu_types")),
    "environment.allow_internet": ("[environment]\nallow_internet = true", ("refused", "network")),
    "environment.network_mode": (
        '[environment]\nnetwork_mode = "allowlist"',
        ("refused", "network_mode 'allowlist'"),
    ),
    "environment.allowed_hosts": (
        '[environment]\nallowed_hosts = ["x.org"]',
        ("refused", "allowed_hosts"),
    ),
    "environment.mcp_servers": (
        '[[environment.mcp_servers]]\nname = "m"\nurl = "http://m"',
        ("refused", "mcp_servers are not supported"),
    ),
    "environment.env": (
        '[environment.env]\nK = "${K}"',
        ("task", "env", {"environment": {"K": "${K}"}}),
    ),
    "environment.skills_dir": ('[environment]\nskills_dir = "/s"', ("refused", "skills_dir in")),
    "environment.healthcheck": (
        '[environment.healthcheck]\ncommand = "true"',
        ("task", "healthcheck", {"command": "true"}),
    ),
    "environment.workdir": (
        '[environment]\nworkdir = "/custom-workdir"',
        ("task", "workdir", "/custom-workdir"),
    ),
    "environment.memory": ('[environment]\nmemory = "2G"', ("refused", "write memory_mb")),
    "environment.storage": ('[environment]\nstorage = "2G"', ("refused", "write storage_mb")),
    "solution.env": (
        '[solution.env]\nK = "${K:-d}"',
        ("task", "env", {"solution": {"K": "${K:-d}"}}),
    ),
}


def test_the_table_covers_every_key_of_the_schema():
    every = {f"{s}.{k}" if s else k for s, keys in KNOWN_KEYS.items() for k in keys}
    # Sections are keys too; their own keys are listed under them.
    assert every - {"task", "agent", "verifier", "environment", "solution"} == set(EVERY_KEY)


@pytest.mark.parametrize("key", sorted(EVERY_KEY))
def test_each_key_is_honoured_or_refused_by_name(tmp_path, key):
    toml, (outcome, *what) = EVERY_KEY[key]
    make_task(tmp_path, "t", toml=toml + "\n")
    if outcome == "refused":
        with pytest.raises(InvalidSpec) as info:
            scan(tmp_path)
        text = " | ".join(info.value.problems)
        assert what[0] in text and "task 't'" in text
        return
    (mapped,) = scan(tmp_path)
    if outcome == "task":
        field, value = what
        assert mapped.task[field] == value
    elif outcome == "requires":
        name, value = what
        assert mapped.requirements == {name: value}
    elif outcome == "warns":
        assert any(what[0] in w and "task 't'" in w for w in mapped.warnings), mapped.warnings
    else:
        assert mapped.warnings == ()


def test_the_descriptive_keys_make_the_description(tmp_path):
    toml = '[task]\ndescription = "Adds numbers."\nkeywords = ["math"]\n[metadata]\n'
    make_task(tmp_path, "t", toml=toml + 'difficulty = "easy"\n')
    (mapped,) = scan(tmp_path)
    assert mapped.task["description"] == "Adds numbers; difficulty: easy; tags: math"


@pytest.mark.parametrize(
    "toml, label",
    [
        ("colour = 1", "unknown key colour"),
        ("[agent]\nmodel = 1", "unknown key [agent] model"),
        ("[environment]\nshm_mb = 1", "unknown key [environment] shm_mb"),
        ("[task]\nlicense = 'MIT'", "unknown key [task] license"),
    ],
)
def test_an_unknown_key_is_refused_naming_it_and_its_file_unless_allowed(tmp_path, toml, label):
    make_task(tmp_path, "t", toml=toml + "\n")
    with pytest.raises(InvalidSpec) as info:
        scan(tmp_path)
    (problem,) = info.value.problems
    assert label in problem and "t/task.toml" in problem and "--allow-unknown-keys" in problem
    (mapped,) = scan(tmp_path, allow_unknown_keys=True)
    (warning,) = mapped.warnings
    assert label in warning and "t/task.toml" in warning


def test_free_form_tables_are_not_walked(tmp_path):
    make_task(tmp_path, "t", toml="[metadata]\nwhatever = 1\n[metadata.deep]\nx = 2\n")
    (mapped,) = scan(tmp_path)
    assert mapped.warnings == ()


@pytest.mark.parametrize("mode, grade", [("shared", "same"), ("separate", "fresh")])
def test_environment_mode_is_our_grade(tmp_path, mode, grade):
    make_task(tmp_path, "t", toml=f'[verifier]\nenvironment_mode = "{mode}"\n')
    (mapped,) = scan(tmp_path)
    assert mapped.task["grade"] == grade


@pytest.mark.parametrize(
    "toml, refused",
    [
        ('[environment]\nworkdir = "relative"', "workdir 'relative'"),
        ('[environment]\nworkdir = "/tmp/x"', "workdir '/tmp/x'"),
        ('[environment]\nworkdir = "/a/../etc"', "workdir '/a/../etc'"),
        ('[verifier]\nenvironment_mode = "elsewhere"', "environment_mode 'elsewhere'"),
        ('[agent]\nuser = "root"', "[agent] user = 'root': sandboxes never run as root"),
        ("[agent]\nuser = 0", "never run as root"),
        ('[agent]\nuser = "app"', "runs as uid 1000 only"),
        ("[verifier]\ntimeout_sec = -1", "[verifier] timeout_sec must be a positive number"),
        ("[environment]\ncpus = true", "[environment] cpus must be a positive number"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_by_name(tmp_path, toml, refused):
    make_task(tmp_path, "t", toml=toml + "\n")
    with pytest.raises(InvalidSpec) as info:
        scan(tmp_path)
    assert refused in " | ".join(info.value.problems)


def test_no_network_spellings_are_honoured(tmp_path):
    toml = (
        '[agent]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "none"\n'
        '[environment]\nallow_internet = false\nnetwork_mode = "no-network"\n'
    )
    make_task(tmp_path, "t", toml=toml)
    assert scan(tmp_path)[0].warnings == ()


def test_the_honoured_fields_are_a_valid_batch_and_checked_there(tmp_path):
    toml = '[verifier]\ntimeout_sec = 5\n[environment]\nworkdir = "/custom-workdir"\n'
    make_task(tmp_path, "t", toml=toml, solution={"solve.sh": "true\n"})
    tasks = [h.task for h in scan(tmp_path)]
    spec = parse_spec({"tasks": tasks, "agent": "oracle"}, max_episodes=None)
    assert spec.tasks[0]["workdir"] == "/custom-workdir"
    assert spec.tasks[0]["test_timeout_seconds"] == 5
    bad = [dict(tasks[0], workdir="/proc/x", test_timeout_seconds=0)]
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": bad, "agent": "oracle"}, max_episodes=None)
    text = " | ".join(info.value.problems)
    assert "workdir '/proc/x'" in text and "test_timeout_seconds must be" in text


def test_kubernetes_runs_one_job_per_workdir_and_no_warm_pool_with_one(tmp_path):
    from rollout_worker.backends.kube.objects import job_manifest, job_parts

    base = {"statement": "s", "test_command": ["true"], "reward": "file", "baseline": False}
    base |= {"files": {}}
    base |= {"tests": {"test.sh": "true\n"}, "solution": {"solve.sh": "true\n"}}
    tasks = [
        base | {"id": "a", "workdir": "/a"},
        base | {"id": "b", "workdir": "/b"},
        base | {"id": "c"},
    ]
    request = {"tasks": tasks, "agent": "oracle", "backend": "kubernetes"}
    spec = parse_spec(request, max_episodes=None)
    # Tasks of one image in different working directories: one Job each, each its own.
    parts = job_parts(spec)
    assert [(p.first, p.count, p.workdir) for p in parts] == [
        (0, 1, "/a"),
        (1, 1, "/b"),
        (2, 1, None),
    ]
    dirs = [
        job_manifest(spec, ttl_seconds_after_finished=60, part=part)["spec"]["template"]["spec"]
        for part in parts
    ]
    working = [
        next(c for c in d["containers"] if c["name"] == "episode").get("workingDir") for d in dirs
    ]
    assert working[:2] == ["/a", "/b"] and working[2] in (None, "/workspace")
    one = [tasks[0]]
    for backend in ("kubernetes", "local"):
        warm = request | {"tasks": one, "warm_pool": 1, "backend": backend}
        with pytest.raises(InvalidSpec) as info:
            parse_spec(warm, max_episodes=None)
        assert "warm_pool cannot go with a task's workdir" in " | ".join(info.value.problems)


# -- limits that follow the tasks -------------------------------------------------------------


def test_an_episode_needs_its_agent_and_test_limits_and_a_margin():
    harbor = {"time_limit_seconds": 120, "test_timeout_seconds": 30, "tests": {"test.sh": ""}}
    assert episode_seconds(harbor) == 120 + 30 + SETUP_MARGIN_SECONDS
    # A baseline run (tests that must fail first) runs the tests twice.
    plain = {"time_limit_seconds": 60}
    assert episode_seconds(plain) == 60 + 2 * 60 + SETUP_MARGIN_SECONDS


def test_the_limits_follow_the_tasks_unless_the_user_set_them():
    slow = {"time_limit_seconds": 120, "test_timeout_seconds": 30, "tests": {"t": ""}}
    fast = {"time_limit_seconds": 10, "test_timeout_seconds": 5, "tests": {"t": ""}}
    episode = 120 + 30 + SETUP_MARGIN_SECONDS
    assert task_limits([slow, fast], 4, 2, episode_timeout=None, deadline=None) == (
        episode,
        2 * episode + DEADLINE_MARGIN_SECONDS,
    )
    # All at once (no parallelism given): one wave.
    assert task_limits([slow], 4, None, episode_timeout=None, deadline=None)[1] == (
        episode + DEADLINE_MARGIN_SECONDS
    )
    # Never below the fixed defaults.
    assert task_limits([fast], 1, 1, episode_timeout=None, deadline=None) == (
        DEFAULT_EPISODE_TIMEOUT_SECONDS,
        DEFAULT_DEADLINE_SECONDS,
    )
    # What the user set wins, and the deadline follows the episode timeout they set.
    assert task_limits([slow], 3, 1, episode_timeout=400, deadline=None) == (
        400,
        3 * 400 + DEADLINE_MARGIN_SECONDS,
    )
    assert task_limits([slow], 3, 1, episode_timeout=None, deadline=999) == (episode, 999)
    # Bounded: a huge batch gets the longest deadline there is.
    assert task_limits([slow], 10**6, 1, episode_timeout=None, deadline=None)[1] == (
        MAX_DEADLINE_SECONDS
    )


def test_a_refused_limit_names_the_flag_to_change():
    task = {"id": "t", "statement": "s", "files": {}, "test_command": ["true"]}
    task |= {"time_limit_seconds": 120, "solution": {"solve.sh": "true\n"}}
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": [task], "agent": "oracle"}, max_episodes=None)
    assert "raise --episode-timeout" in " | ".join(info.value.problems)
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"episode_timeout_seconds": 300, "deadline_seconds": 240}, max_episodes=None)
    assert "raise --deadline" in " | ".join(info.value.problems)


# -- where each backend puts a task's workdir -------------------------------------------------


def test_a_local_sandbox_mounts_its_workspace_at_the_tasks_workdir(tmp_path):
    from tests.unit.test_sandbox_argv import plan

    argv = plan(tmp_path, workdir="/custom-workdir").argv
    at = argv.index(str(tmp_path / "ws"))
    assert argv[at - 1 : at + 2] == ["--bind", str(tmp_path / "ws"), "/custom-workdir"]
    assert argv[argv.index("--chdir") + 1] == "/custom-workdir"
    setenv = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--setenv"]
    assert ["ROLLOUT_WORKSPACE", "/custom-workdir"] in setenv
    plain = plan(tmp_path).argv
    assert plain[plain.index("--chdir") + 1] == "/workspace"


def kube_pod(tasks: list[dict[str, Any]], **changes: Any) -> dict[str, Any]:
    from rollout_worker.backends.kube.objects import job_manifest

    base = {"statement": "s", "files": {}, "test_command": ["true"], "reward": "file"}
    base |= {"baseline": False, "tests": {"test.sh": "true\n"}, "solution": {"solve.sh": "x"}}
    request = {"tasks": [base | t for t in tasks], "agent": "oracle", "backend": "kubernetes"}
    spec = parse_spec(request | changes, max_episodes=100)
    return job_manifest(spec, ttl_seconds_after_finished=60)["spec"]["template"]["spec"]


def test_a_kubernetes_sandbox_works_in_the_tasks_workdir():
    container = kube_pod([{"id": "a", "workdir": "/custom-workdir"}])["containers"][0]
    assert container["workingDir"] == "/custom-workdir"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ROLLOUT_WORKSPACE"] == "/custom-workdir"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["workspace"] == "/custom-workdir"
    # In its own image the folder's files are the image's: no volume hides them.
    own = kube_pod([{"id": "a", "workdir": "/custom-workdir", "image": "team/env:1"}])
    container = own["containers"][0]
    assert container["workingDir"] == "/custom-workdir"
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["workspace"] == (
        "/workspace"
    )
    plain = kube_pod([{"id": "a"}])["containers"][0]
    assert plain["workingDir"] == "/workspace"


# -- rollout run --tasks: limits and resources that follow the tasks ---------------------------


def run_limits(tmp_path, toml: str, **flags: Any) -> dict[str, Any]:
    from rollout_worker.cli.run import _limits

    make_task(tmp_path, "t", toml=toml, solution={"solve.sh": "true\n"})
    tasks = [h.task for h in scan(tmp_path)]
    options = {
        "deadline_seconds": None,
        "episode_timeout_seconds": None,
        "cpu_limit": None,
        "memory_limit": None,
        "storage_limit": None,
    } | flags
    return _limits({"tasks": tasks, "samples_per_task": 2}, str(tmp_path), (), False, **options)


def test_rollout_run_takes_the_limits_a_task_states(tmp_path):
    toml = "[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 30\n"
    toml += "[environment]\ncpus = 2\nmemory_mb = 2048\nstorage_mb = 64\n"
    fields = run_limits(tmp_path, toml)
    episode = 120 + 30 + SETUP_MARGIN_SECONDS
    assert fields["episode_timeout_seconds"] == episode
    assert fields["deadline_seconds"] == episode + DEADLINE_MARGIN_SECONDS  # 2 at once
    assert fields["resources"] == {"cpu_limit": "2", "memory_limit": "2Gi", "storage_limit": "64Mi"}
    # The batch they make is valid without any limit flag.
    make = {"tasks": [h.task for h in scan(tmp_path)], "agent": "oracle", "samples_per_task": 2}
    parse_spec(make | fields, max_episodes=None)


def test_rollout_run_flags_win_and_a_smaller_resource_flag_is_refused_by_name(tmp_path):
    toml = "[agent]\ntimeout_sec = 120\n[environment]\ncpus = 2\nmemory_mb = 2048\n"
    toml += "storage_mb = 2048\n"
    fields = run_limits(tmp_path, toml, episode_timeout_seconds=500, cpu_limit="4")
    assert fields["episode_timeout_seconds"] == 500
    assert fields["resources"]["cpu_limit"] == "4"
    assert fields["resources"]["storage_limit"] == "2Gi"
    assert (
        run_limits(tmp_path / "more", toml, storage_limit="3Gi")["resources"]["storage_limit"]
        == "3Gi"
    )
    with pytest.raises(InvalidSpec) as info:
        run_limits(tmp_path / "again", toml, cpu_limit="1", memory_limit="1Gi", storage_limit="1Gi")
    text = " | ".join(info.value.problems)
    assert "--storage-limit 1Gi is below the 2048 MB a task states ([environment] storage_mb)" in (
        text
    )
    assert "--cpu-limit 1 is below the 2 CPUs a task states ([environment] cpus)" in text
    assert "--memory-limit 1Gi is below the 2048 MB a task states" in text


def test_rollout_run_keeps_the_fixed_defaults_for_tasks_that_state_nothing(tmp_path):
    fields = run_limits(tmp_path, 'version = "1.0"\n')
    assert fields["resources"] == {
        "cpu_limit": "500m",
        "memory_limit": "128Mi",
        "storage_limit": "1Gi",
    }
    assert fields["deadline_seconds"] >= DEFAULT_DEADLINE_SECONDS


def test_rollout_run_lists_the_keys_it_does_not_enforce_before_the_run(tmp_path, capsys):
    run_limits(tmp_path, "[environment]\nbuild_timeout_sec = 600\n")
    printed = " ".join(capsys.readouterr().err.split())
    assert "warning: task 't': [environment] build_timeout_sec = 600 not enforced" in printed


# -- a key let through is said wherever tasks are loaded ---------------------------------------


def test_loading_tasks_in_python_warns_of_each_key_let_through(tmp_path):
    make_task(tmp_path, "t", toml="colour = 1\n[environment]\nbuild_timeout_sec = 600\n")
    with pytest.warns(TaskWarning) as caught:
        (task,) = load_task_set(str(tmp_path), allow_unknown_keys=True)
    messages = [str(w.message) for w in caught]
    assert task["id"] == "t"
    assert any("unknown key colour" in m for m in messages), messages
    assert any("build_timeout_sec = 600 not enforced" in m for m in messages), messages


@pytest.mark.parametrize("command", [["show"], ["build", "--dry-run"]])
def test_tasks_commands_refuse_an_unknown_key_unless_allowed_and_then_say_it(tmp_path, command):
    from click.testing import CliRunner

    from rollout_worker.cli.main import cli

    make_task(tmp_path, "t", toml="colour = 1\n", solution={"solve.sh": "true\n"})
    refused = CliRunner().invoke(cli, ["tasks", *command, str(tmp_path)])
    assert refused.exit_code == 1 and "--allow-unknown-keys" in refused.output, refused.output
    allowed = CliRunner().invoke(cli, ["tasks", *command, "--allow-unknown-keys", str(tmp_path)])
    assert allowed.exit_code == 0, allowed.output
    said = " ".join(allowed.output.split())
    assert said.count("warning: task 't': unknown key colour") == 1, allowed.output


def test_the_keys_let_through_ride_with_the_request_into_its_report(tmp_path):
    from rollout_wire.tasksets import rollout_fields
    from rollout_worker.backends.base import RunHandle
    from rollout_worker.report import build_report

    make_task(tmp_path, "t", toml="colour = 1\n", solution={"solve.sh": "true\n"})
    with pytest.warns(TaskWarning, match="unknown key colour"):  # still said to the caller
        fields = rollout_fields(
            tasks=str(tmp_path), samples=1, policy_url=None, allow_unknown_keys=True
        )
    (said,) = fields["task_warnings"]
    assert "unknown key colour" in said and "t/task.toml" in said
    spec = parse_spec({"parallelism": 1, "agent": "oracle"} | fields, max_episodes=None)
    run = RunHandle("local", spec.batch_id, origin=0.0, episode_prefix="r", context="")
    report = build_report(spec, [], run, None, finalized_by="test", reported_at=1.0)
    assert report["warnings"][0] == said
    # A request that carries something else there is refused before anything runs.
    with pytest.raises(InvalidSpec, match="task_warnings must be a list"):
        parse_spec({"agent": "oracle"} | fields | {"task_warnings": "x"}, max_episodes=None)
