"""Task sets as data, and the request fields of real rollouts (tasks, samples, policy)."""

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import DEMO_TASK_ID, MAX_TASKS_BYTES, BatchSpec, parse_spec
from rollout_wire.tasksets import bundled_tasks, load_task_set

POLICY = {"url": "http://127.0.0.1:8000", "model": "m", "sampling": {"temperature": 0.7}}


def problems(request):
    with pytest.raises(InvalidSpec) as info:
        parse_spec(request, max_episodes=1000)
    return " | ".join(info.value.problems)


def test_the_bundled_set_has_at_least_8_distinct_tasks_with_distinct_files():
    tasks = bundled_tasks()
    assert len(tasks) >= 8
    assert len({t["id"] for t in tasks}) == len(tasks)
    files = [frozenset(t["files"]) for t in tasks]
    assert len(set(files)) == len(tasks)  # different files, not one repo with renamed ids
    assert any(t.get("max_steps", 10) > 3 and len(t["files"]) > 2 for t in tasks)  # multi-step
    assert {t.get("reward", "all") for t in tasks} == {"all", "fraction"}
    parse_spec({"tasks": tasks, "policy": POLICY}, max_episodes=1000)  # every task is valid


def test_a_batch_is_the_task_set_times_samples_and_each_episode_knows_its_task_and_group():
    tasks = load_task_set("bundled", only=["leap-year", "stack-pop", "palindrome"])
    spec = parse_spec({"tasks": tasks, "samples_per_task": 4, "policy": POLICY}, max_episodes=1000)
    assert spec.count == 12 and spec.parallelism == 12
    assert [spec.episode(i).task_id for i in (0, 3, 4, 11)] == [
        "leap-year",
        "leap-year",
        "stack-pop",
        "palindrome",
    ]
    assert [spec.episode(i).sample for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    groups = {spec.episode(i).group_id for i in range(12)}
    assert len(groups) == 3 and all(g.startswith(spec.batch_id + ":") for g in groups)
    assert spec.policy is not None and spec.policy.to_dict() == {
        "url": "http://127.0.0.1:8000",
        "model": "m",
        "sampling": {"temperature": 0.7},
        "request_timeout_seconds": 60,
        "max_retries": 2,
        "max_policy_lag": None,
        "trainer": "default",
        "tokens": True,
    }
    # The spec travels as JSON (receipt) and decodes to the same thing.
    assert BatchSpec.from_dict(spec.to_dict()) == spec


def test_without_tasks_the_demo_is_one_built_in_task_with_count_samples():
    spec = parse_spec({"count": 10}, max_episodes=100)
    assert spec.tasks == [] and spec.policy is None and spec.action == "fix"
    assert {spec.episode(i).task_id for i in range(10)} == {DEMO_TASK_ID}
    assert [spec.episode(i).sample for i in range(10)] == list(range(10))


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        ({"tasks": "bundled", "policy": POLICY}, "tasks must be a list"),
        ({"tasks": [{"id": "Bad Id"}], "policy": POLICY}, "task id 'Bad Id'"),
        ({"samples_per_task": 3}, "samples_per_task needs tasks"),
        ({"tasks": bundled_tasks()[:1]}, "tasks need a policy"),
        ({"tasks": bundled_tasks()[:2], "count": 5, "policy": POLICY}, "disagrees with 2 task"),
        ({"policy": {"url": "ftp://x"}}, "policy.url 'ftp://x'"),
        ({"policy": {"url": "http://x", "sampling": {"messages": []}}}, "may not set"),
        ({"policy": {"url": "http://x", "colour": 1}}, "unknown policy fields"),
    ],
)
def test_bad_tasks_and_policies_are_refused_with_what_is_allowed(request_, expected):
    assert expected in problems(request_)


def test_every_task_problem_is_listed_at_once():
    bad = {
        "id": "t1",
        "statement": "",
        "files": {"../escape.py": "x", "/abs": "y"},
        "test_command": "python -m unittest",
        "reward": "most",
        "max_steps": 0,
        "shown": True,
    }
    text = problems({"tasks": [bad, dict(bad)], "policy": POLICY})
    for part in (
        "statement",
        "'../escape.py'",
        "'/abs'",
        "test_command",
        "reward 'most'",
        "max_steps",
        "unknown fields ['shown']",
        "appears twice",
    ):
        assert part in text, part


def test_tasks_above_the_configmap_budget_are_refused_with_a_clear_error():
    big = dict(bundled_tasks()[0], files={"blob.py": "#" * (MAX_TASKS_BYTES + 10)})
    text = problems({"tasks": [big], "policy": POLICY})
    assert "above the" in text and "1 MiB" in text and "split" in text


def test_a_task_set_file_and_unknown_names(tmp_path):
    path = tmp_path / "set.json"
    path.write_text('{"tasks": [{"id": "a"}]}')
    assert load_task_set(str(path)) == [{"id": "a"}]
    with pytest.raises(InvalidSpec, match="no such file"):
        load_task_set(str(tmp_path / "missing.json"))
    with pytest.raises(InvalidSpec, match="has no task"):
        load_task_set("bundled", only=["nope"])


def test_the_agent_s_view_of_a_task_with_hidden_tests_runs_no_baseline(tmp_path):
    # The agent's runner never holds hidden tests, so a baseline there runs none, and a run of
    # no tests passes: every episode of such a task failed "tests pass before any action".
    from rollout_wire.tasksets import agent_view
    from rollout_worker.sandbox.runner.runner import Runner

    hidden = {"id": "t", "files": {"a.py": "x = 1\n"}, "tests": {"test_a.py": "assert False\n"}}
    view = agent_view(hidden)
    assert "tests" not in view and view["baseline"] is False
    assert not Runner(view, None, {}, str(tmp_path)).wants_baseline()
    # A task whose tests the agent's sandbox holds keeps its baseline.
    visible = {"id": "v", "files": {"a.py": "x = 1\n"}, "test_files": {"test_a.py": "x\n"}}
    assert "baseline" not in agent_view(visible)
    assert Runner(agent_view(visible), None, {}, str(tmp_path)).wants_baseline()
