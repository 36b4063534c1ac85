"""`rollout tasks check`: the pure parts (what it submits, how rows become a verdict, the table
and the exit status), and how `rollout tasks build` names a base image it cannot get."""

from __future__ import annotations

from pathlib import Path

from rollout_wire import harbor
from rollout_wire.request import parse_spec
from rollout_wire.tasksets import load_task_set
from rollout_worker.cli import base_images as cli_base
from rollout_worker.cli import check
from rollout_worker.cli import tasks as cli_tasks
from rollout_worker.cli.check import Outcome, TaskCheck

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "harbor"


def row(task_id: str, reward: float = 1.0, **extra) -> dict:
    return {
        "task_id": task_id,
        "status": "ok",
        "reward": reward,
        "created_at": 100.0,
        "finished_at": 102.5,
        "agent_exit_code": 0,
        "grade_cause": None,
    } | extra


def report(*rows: dict, **extra) -> dict:
    return {"status": "succeeded", "pods": list(rows), "errors": []} | extra


TASKS = [
    {"id": "good", "solution": {"solve.sh": "x"}},
    {"id": "bad-oracle", "solution": {"solve.sh": "x"}},
    {"id": "free-reward", "solution": {"solve.sh": "x"}},
    {"id": "unsolved"},
]


def test_the_batches_run_the_oracle_where_there_is_one_and_the_nop_everywhere():
    tasks = load_task_set(str(FIXTURES))
    oracle = check.oracle_tasks(tasks)
    assert "no-solution" not in [t["id"] for t in oracle]
    assert {t["agent"] for t in oracle} == {"oracle"}
    nop = check.nop_tasks(tasks)
    assert [t["id"] for t in nop] == [t["id"] for t in tasks]
    assert all(t["agent"] == check.NOP_AGENT for t in nop)
    # What the command submits is a valid batch: the oracle needs no policy, the nop names one
    # that nothing asks.
    episode, deadline = check.limits(tasks)
    limits = {"episode_timeout_seconds": episode, "deadline_seconds": deadline}
    assert parse_spec({"tasks": oracle} | limits, max_episodes=100).count == len(oracle)
    spec = parse_spec({"tasks": nop, "policy": check.NEVER_ASKED_POLICY} | limits, max_episodes=100)
    assert spec.count == len(tasks)


def test_a_task_with_steps_has_an_oracle_when_every_step_has_a_solve_sh():
    (two,) = load_task_set(str(FIXTURES / "multi-step"))
    assert check.has_solution(two) and check.oracle_tasks([two])[0]["agent"] == "oracle"
    one_short = dict(two, steps=[two["steps"][0], {**two["steps"][1], "solution": {}}])
    assert not check.has_solution(one_short) and check.oracle_tasks([one_short]) == []


def test_limits_fit_the_longest_task():
    assert check.limits([{"time_limit_seconds": 30}]) == (120, 240)
    assert check.limits([{"time_limit_seconds": 30}, {"time_limit_seconds": 300}]) == (360, 480)
    assert check.limits([]) == (120, 240)


def test_the_batches_limits_are_the_largest_a_task_states():
    # As `rollout run --tasks` without --cpu-limit / --memory-limit: a task is judged under
    # the limits it asks for (the fixture `limits` needs its memory_mb).
    stated = [{"cpus": 1, "memory_mb": 512, "storage_mb": 100}, {"memory_mb": 640}, {}]
    assert check.resources(stated) == {
        "cpu_limit": "1",
        "memory_limit": "640Mi",
        "storage_limit": "100Mi",
    }
    assert check.resources([{}, {}]) == {}  # none stated: the batch's defaults
    tasks = harbor.scan(FIXTURES)
    limits = check.resources([h.requirements for h in tasks])
    # add-numbers states storage_mb = 1024, the largest
    assert limits["memory_limit"] == "640Mi" and limits["storage_limit"] == "1Gi"


def test_a_row_becomes_an_outcome_with_its_cause():
    empty = report()
    assert check.outcome(row("a"), empty) == Outcome(1.0, 2.5, None)
    graded = check.outcome(
        row("a", 0.0, grade_cause="reward_file", agent_exit_code=2, agent_output="a\nboom\n\n"),
        empty,
    )
    assert graded == Outcome(0.0, 2.5, "reward_file, agent exited 2", said="boom")
    long = check.outcome(row("a", agent_output="x" * 200), empty).said or ""
    assert len(long) == check.SAID_CHARS and long.endswith("...")
    timed_out = check.outcome(row("a", 0.0, agent_exit_code=None, stop_reason="time_limit"), empty)
    assert timed_out.detail == "agent timed out"
    infra = row(
        "a", 0, status="failed", failure_kind="infrastructure", failure_cause="sandbox never ready"
    )
    assert check.outcome(infra, empty) == Outcome(
        None, 2.5, "failed: sandbox never ready", infrastructure=True
    )
    episode = row("a", 0, status="failed", failure_kind="episode", errors=["bad record"])
    assert check.outcome(episode, empty) == Outcome(None, 2.5, "failed: bad record")
    assert check.outcome(row("a", status="lost"), empty).infrastructure
    rejected = report(status="rejected", errors=["no root filesystem for image x"])
    missing = check.outcome(None, rejected)
    assert missing.infrastructure and "no root filesystem for image x" in (missing.detail or "")


def checks_of(nop_rows, oracle_rows=None, build_errors=None):
    oracle_rows = oracle_rows or [
        row("good"),
        row("bad-oracle", 0.0, grade_cause="reward_file", agent_output="nothing to fix\n"),
        row("free-reward"),
    ]
    return check.collect(
        TASKS,
        report(*oracle_rows),
        report(*nop_rows) if nop_rows is not None else None,
        build_errors or {},
    )


NOP_ROWS = [row(t["id"], 0.0, grade_cause="reward_file") for t in TASKS]


def test_the_table_shows_each_reward_and_the_cause_of_each_failure():
    nop_rows = [*NOP_ROWS[:2], row("free-reward", 0.5), NOP_ROWS[3]]
    checks = checks_of(nop_rows)
    table = check.table(checks, nop=True)
    assert table == [
        ["TASK", "ORACLE", "NOP", "SECONDS", "RESULT", "CAUSE"],
        ["good", "1", "0", "2.5", "ok", ""],
        [
            "bad-oracle",
            "0",
            "0",
            "2.5",
            "FAIL",
            "oracle scored 0 (reward_file); solve.sh's last line: 'nothing to fix'",
        ],
        [
            "free-reward",
            "1",
            "0.5",
            "2.5",
            "FAIL",
            "nop scored 0.5: the tests reward an untouched task",
        ],
        [
            "unsolved",
            "no oracle",
            "0",
            "2.5",
            "FAIL",
            "no oracle: no solution/solve.sh to prove the task solvable",
        ],
    ]
    assert check.exit_status(checks) == check.EXIT_FAILED
    assert check.summary(checks) == (
        "4 tasks: 1 passed, 3 failed (bad-oracle, free-reward, unsolved)"
    )
    # It prints as aligned columns.
    lines = cli_tasks.format_rows(table)
    assert lines[1].split() == ["good", "1", "0", "2.5", "ok"]


def test_exit_status_zero_only_when_every_oracle_scores_one_and_every_nop_zero():
    good = check.collect(TASKS[:1], report(row("good")), report(row("good", 0.0)), {})
    assert check.exit_status(good) == check.EXIT_OK
    assert check.summary(good) == "1 task: 1 passed"
    # Without --nop the nop column is "-" and judges nothing.
    no_nop = check.collect(TASKS[:1], report(row("good")), None, {})
    assert check.table(no_nop, nop=False)[1] == ["good", "1", "-", "2.5", "ok", ""]
    assert check.exit_status(no_nop) == check.EXIT_OK
    # A fractional oracle is below 1: a failure.
    partial = check.collect(TASKS[:1], report(row("good", 0.75)), None, {})
    assert check.exit_status(partial) == check.EXIT_FAILED


def test_a_task_without_a_solution_fails_unless_allowed():
    unsolved = check.collect(TASKS[3:], report(), report(row("unsolved", 0.0)), {})
    assert check.exit_status(unsolved) == check.EXIT_FAILED
    assert check.exit_status(unsolved, allow_no_oracle=True) == check.EXIT_OK
    assert check.table(unsolved, nop=True, allow_no_oracle=True)[1][1:5] == [
        "no oracle",
        "0",
        "2.5",
        "ok",
    ]


def test_infrastructure_failures_leave_tasks_unjudged_and_say_so():
    lost = row("good", 0, status="lost", failure_cause="deadline")
    checks = check.collect(TASKS[:1], report(lost), report(row("good", 0.0)), {})
    assert check.table(checks, nop=True)[1] == [
        "good",
        "infra",
        "0",
        "2.5",
        "INCOMPLETE",
        "oracle infrastructure: lost: deadline",
    ]
    assert check.exit_status(checks) == check.EXIT_INCOMPLETE
    assert check.summary(checks) == (
        "1 task: 0 passed, 1 not judged: an episode failed for infrastructure (good); "
        "run the check again"
    )
    # A task that fails for itself wins over another's infrastructure failure.
    mixed = check.collect(TASKS[:2], report(lost, row("bad-oracle", 0.0)), None, {})
    assert check.exit_status(mixed) == check.EXIT_FAILED
    # A batch refused as a whole: every task says why.
    refused = check.collect(TASKS[:1], report(status="rejected", errors=["no rootfs"]), None, {})
    assert check.table(refused, nop=False)[1][4:] == [
        "INCOMPLETE",
        "oracle infrastructure: no episode ran (no rootfs)",
    ]


def test_a_task_whose_image_did_not_build_fails_with_the_build_error():
    checks = check.collect(TASKS[:1], None, None, {"good": "cannot get its base image x:1"})
    assert check.table(checks, nop=True)[1] == [
        "good",
        "not built",
        "not built",
        "-",
        "FAIL",
        "build failed: cannot get its base image x:1",
    ]
    assert check.table(checks, nop=False)[1][1:3] == ["not built", "-"]
    assert check.exit_status(checks) == check.EXIT_FAILED
    # A long, multi-line build error: its first line, cut, in the table.
    long = "cannot get its base image " + "x" * 300 + "\n  provide it: ..."
    cause = check.problems(TaskCheck("good", True, build_error=long))[0]
    assert cause.startswith("build failed: cannot get") and "\n" not in cause
    assert len(cause) == len("build failed: ") + check.BUILD_ERROR_CHARS


# -- `rollout tasks build`: the base images a Dockerfile needs ----------------------------------


def test_the_bases_of_multi_stage_arg_and_platform_dockerfiles():
    dockerfile = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=debian:12\n"
        "ARG TAG\n"
        'ARG REG="reg.example:5000"\n'
        "FROM --platform=linux/amd64 ${BASE} AS build\n"
        "ARG BASE=ignored:1\n"  # an ARG after the first FROM is the stage's, not a FROM's
        "RUN make \\\n"
        "    all\n"
        "FROM $REG/tools:${TAG:-7} AS tools\n"
        "from build\n"
        "COPY --from=build /out /out\n"
        "COPY --from=0 /a /a\n"
        "COPY --from=busybox:1.36 /bin/sh /sh\n"
        "FROM scratch\n"
        "FROM ${UNSET}\n"
    )
    assert cli_base.dockerfile_bases(dockerfile) == [
        "debian:12",
        "reg.example:5000/tools:7",
        "busybox:1.36",
        "${UNSET}",
    ]
    assert cli_base.substitute_args("${A:+set}-${B:-b}-$A", {"A": "a"}) == "set-b-a"


def test_the_message_for_a_base_it_cannot_get_names_it_and_how_to_provide_it():
    assert cli_base.registry_of("python:3.12") == "docker.io"
    assert cli_base.registry_of("library/python") == "docker.io"
    assert cli_base.registry_of("ghcr.io/a/b:1") == "ghcr.io"
    assert cli_base.registry_of("localhost/a") == "localhost"
    message = cli_base.missing_base_message(
        "rollout.local/harbor-t:1",
        ["python:3.12", "ghcr.io/a/b:1", "${UNSET}"],
        ["python:3.12", "ghcr.io/a/b:1", "${UNSET}"],
        "Step 1/3 : FROM python:3.12\ndial tcp: lookup registry-1.docker.io: no such host\n",
    )
    lines = message.splitlines()
    assert lines[0] == (
        "docker build of rollout.local/harbor-t:1: cannot get its base image python:3.12, "
        "ghcr.io/a/b:1, ${UNSET} (not in the local Docker, and pulling it failed): dial tcp: "
        "lookup registry-1.docker.io: no such host"
    )
    assert lines[1].startswith("  provide python:3.12: `docker tag <an image you have> python")
    assert "registry-mirrors" in lines[1]
    assert "make ghcr.io reachable (`docker login ghcr.io`" in lines[2]
    assert "registry-mirrors" not in lines[2]
    assert "a build arg without a default" in lines[3]
    # Every base local, yet docker went to a registry: the platform is the likely cause.
    local = cli_base.missing_base_message("i:1", ["python:3.12"], [], "no match for platform")
    assert "for another platform?" in local.splitlines()[0]


# -- the command, its batches stood in for ------------------------------------------------------


def test_the_command_submits_one_oracle_and_one_nop_batch_and_exits_with_the_verdict(
    monkeypatch, tmp_path
):
    from click.testing import CliRunner

    from rollout_worker.cli.main import cli

    sent = {}

    def fake_batches(requests, settings, all_in_one, rootfs):
        sent.update(requests, all_in_one=all_in_one, rootfs=rootfs)
        oracle = [
            row(t["id"], 0.0 if t["id"] == "wrong-oracle" else 1.0)
            for t in requests["oracle"]["tasks"]
        ]
        if "nop" not in requests:
            return {"oracle": report(*oracle)}
        nop = [row(t["id"], 0.0) for t in requests["nop"]["tasks"]]
        return {"oracle": report(*oracle), "nop": report(*nop)}

    monkeypatch.setattr(cli_tasks, "_run_check_batches", fake_batches)
    picked = ["--task", "add-numbers", "--task", "no-solution", "--task", "wrong-oracle"]
    args = ["tasks", "check", str(FIXTURES), *picked, "--nop", "--rootfs", str(tmp_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == check.EXIT_FAILED, result.output
    assert [t["id"] for t in sent["oracle"]["tasks"]] == ["add-numbers", "wrong-oracle"]
    assert [t["id"] for t in sent["nop"]["tasks"]] == ["add-numbers", "no-solution", "wrong-oracle"]
    assert sent["nop"]["policy"] == check.NEVER_ASKED_POLICY and "policy" not in sent["oracle"]
    assert sent["oracle"]["episode_timeout_seconds"] == 120 and sent["all_in_one"] is True
    assert sent["rootfs"] == tmp_path.resolve()
    lines = result.output.splitlines()
    assert lines[-1] == "3 tasks: 1 passed, 2 failed (no-solution, wrong-oracle)"
    # Without --nop, on the passing task alone: exit 0, no nop batch.
    sent.clear()
    result = CliRunner().invoke(cli, ["tasks", "check", str(FIXTURES), "--task", "add-numbers"])
    assert result.exit_code == 0, result.output
    assert "nop" not in sent
    assert result.output.splitlines()[-2].split() == ["add-numbers", "1", "-", "2.5", "ok"]
