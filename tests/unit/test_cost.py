"""The cost ledger: the runner's readers (/proc, cgroup files) on fake trees and on this
machine, its policy counts, validation copying and checking `cost`, the report's sums, and slot
utilisation."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from rollout_wire.request import parse_spec
from rollout_wire.rows import EpisodeRow
from rollout_worker.backends.base import RunHandle
from rollout_worker.cli.plots import busy_spans, episode_cpu, render_timeline
from rollout_worker.cli.policy_server import running
from rollout_worker.cli.report import render_markdown, summary_tables
from rollout_worker.metrics import busy_slots, slot_utilisation
from rollout_worker.observation import EpisodeObservation
from rollout_worker.report import build_report
from rollout_worker.validation import validate_episode
from tests.runner_program import episode
from tests.unit.test_agent_command import (
    SCRIPT,
    STREAM_AGENT,
    TASK,
    SSEHandler,
    agent_task,
    baseline_of,
    row_of,
    run_runner,
)

TICKS = 100  # clock ticks per second in the fake /proc


# -- the readers -------------------------------------------------------------------------------
def fake_process(root, pid, ppid, utime, stime, cutime=0, cstime=0, hwm_kb=None, comm="x"):
    folder = root / str(pid)
    folder.mkdir()
    (folder / "stat").write_text(
        f"{pid} ({comm}) S {ppid} 1 1 0 -1 4194304 10 0 0 0 {utime} {stime} {cutime} {cstime} "
        "20 0 1 0 100 1000 50\n"
    )
    if hwm_kb is not None:
        (folder / "status").write_text(
            f"Name:\t{comm}\nVmPeak:\t 99999999 kB\nVmHWM:\t {hwm_kb} kB\nVmRSS:\t 10 kB\n"
        )


@pytest.fixture
def proc(tmp_path):
    """A sandbox's PID namespace: bwrap's init (1, which reaped an orphan: its cutime), the
    runner (2, with the tests it waited for in its cutime), the agent (7) and its child (8, a
    command name with a ") S 1 (" in it), and a process the runner did not start (12)."""
    root = tmp_path / "proc"
    root.mkdir()
    fake_process(root, 1, 0, 1, 1, cutime=50, cstime=10, hwm_kb=1000, comm="bwrap")
    fake_process(root, 2, 1, 20, 5, cutime=300, cstime=40, hwm_kb=30000, comm="python3")
    fake_process(root, 7, 2, 100, 10, hwm_kb=50000, comm="agent")
    fake_process(root, 8, 7, 30, 0, hwm_kb=200000, comm="evil) S 1 (")
    fake_process(root, 12, 1, 400, 0, hwm_kb=900000, comm="other")
    (root / "self").mkdir()  # not a process
    (root / "99").mkdir()  # gone before its stat was read
    (root / "100").mkdir()
    (root / "100" / "stat").write_text("junk")
    return root


def test_proc_sums_every_process_of_the_namespace_with_their_reaped_children(proc):
    cost = episode.read_proc(str(proc), ticks=TICKS)
    # user: utime + cutime of 1, 2, 7, 8, 12; system: stime + cstime.
    assert cost["cpu_user_seconds"] == pytest.approx((51 + 320 + 100 + 30 + 400) / TICKS)
    assert cost["cpu_system_seconds"] == pytest.approx((11 + 45 + 10) / TICKS)
    assert cost["cpu_seconds"] == pytest.approx(cost["cpu_user_seconds"] + 0.66)
    # The largest single process, not a sum.
    assert cost["peak_memory_bytes"] == 900000 * 1024
    assert cost["cpu_source"] == "proc"


def test_proc_scoped_to_the_runner_counts_its_tree_and_nothing_else(proc):
    cost = episode.read_proc(str(proc), scope=2, ticks=TICKS)
    assert cost["cpu_user_seconds"] == pytest.approx((320 + 100 + 30) / TICKS)
    assert cost["cpu_system_seconds"] == pytest.approx((45 + 10) / TICKS)
    assert cost["peak_memory_bytes"] == 200000 * 1024  # 12's larger peak is not the episode's


def test_an_unreadable_proc_leaves_the_cpu_unknown(tmp_path, proc):
    for cost in (
        episode.read_proc(str(tmp_path / "nothing"), ticks=TICKS),
        episode.read_proc(str(proc), scope=4242, ticks=TICKS),  # the runner is not there
    ):
        assert cost["cpu_seconds"] is None and cost["cpu_user_seconds"] is None
        assert cost["peak_memory_bytes"] is None


PROC_CHECK = """
import os, subprocess, sys
from tests.runner_program import episode
# A child that burns CPU and is waited for: its time is in this process's cutime.
subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(3_000_000): x += i"], check=True)
times = os.times()
cost = episode.read_proc(scope=os.getpid())
after = os.times()
before_total = times.user + times.system + times.children_user + times.children_system
after_total = after.user + after.system + after.children_user + after.children_system
tick = 1 / os.sysconf("SC_CLK_TCK")
assert before_total - tick <= cost["cpu_seconds"] <= after_total + tick, (cost, times, after)
assert cost["cpu_seconds"] >= times.children_user, (cost, times)  # the child's loop is in it
"""


def test_proc_on_this_machine_agrees_with_the_kernels_own_times():
    # In a fresh process whose only child is the burner: the test runner's own tree may hold
    # live services (their CPU is in /proc, but in none of the runner's os.times()).
    done = subprocess.run([sys.executable, "-c", PROC_CHECK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def cgroup_files(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_files_are_read_as_seconds_and_bytes(tmp_path):
    root = cgroup_files(
        tmp_path,
        {
            "cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 0\n",
            "memory.peak": "123456789\n",
        },
    )
    assert episode.read_cgroup(str(root)) == {
        "cpu_seconds": 2.5,
        "cpu_user_seconds": 2.0,
        "cpu_system_seconds": 0.5,
        "peak_memory_bytes": 123456789,
        "cpu_source": "cgroup",
    }


def test_cgroup_v1_files_and_missing_ones(tmp_path):
    root = cgroup_files(
        tmp_path / "v1",
        {
            "cpuacct/cpuacct.usage": "3000000000\n",  # nanoseconds
            "cpuacct/cpuacct.stat": "user 250\nsystem 50\n",  # clock ticks
            "memory/memory.max_usage_in_bytes": "4096\n",
        },
    )
    cost = episode.read_cgroup(str(root), ticks=TICKS)
    assert (cost["cpu_seconds"], cost["cpu_user_seconds"], cost["cpu_system_seconds"]) == (
        3.0,
        2.5,
        0.5,
    )
    assert cost["peak_memory_bytes"] == 4096
    empty = episode.read_cgroup(str(tmp_path / "none"))
    assert [empty[k] for k in ("cpu_seconds", "cpu_user_seconds", "peak_memory_bytes")] == [
        None,
        None,
        None,
    ]


def test_the_source_decides_what_is_read(tmp_path):
    pid = os.getpid()
    root = tmp_path / "proc"
    root.mkdir()
    huge = 2**40 // 1024  # kB: larger than any real process, so it is the peak
    fake_process(root, pid, 1, 100, 0)
    fake_process(root, pid + 10**7, pid, 50, 0, hwm_kb=huge)
    fake_process(root, pid + 2 * 10**7, 1, 1000, 0)  # not the runner's
    cgroup = cgroup_files(tmp_path / "cg", {"cpu.stat": "usage_usec 7000000\n"})
    ticks = os.sysconf("SC_CLK_TCK")

    read = episode.read_usage("cgroup", str(cgroup), str(root))
    assert read["cpu_source"] == "cgroup" and read["cpu_seconds"] == 7.0
    assert read["peak_memory_bytes"] is None  # no memory file: unknown, not guessed
    # Kubernetes without cgroup files: its PID namespace is its own, every process counts.
    read = episode.read_usage("cgroup", str(tmp_path / "none"), str(root))
    assert read["cpu_source"] == "proc" and read["cpu_seconds"] == pytest.approx(1150 / ticks)
    assert episode.read_usage("proc", "", str(root))["cpu_seconds"] == pytest.approx(1150 / ticks)
    # No namespace of its own: the runner's tree only.
    read = episode.read_usage(None, "", str(root))
    assert read["cpu_seconds"] == pytest.approx(150 / ticks)
    assert read["peak_memory_bytes"] == huge * 1024


# -- the policy's figures ------------------------------------------------------------------------
def test_the_ledger_counts_turns_tokens_and_waits():
    ledger = episode.Ledger()
    ledger.turn({"usage": {"prompt_tokens": 10, "completion_tokens": 3}}, 0.5)
    ledger.turn({"choices": []}, 0.25)  # no usage: a turn, no tokens
    ledger.turn(None, 1.0)  # never answered
    ledger.turn({"usage": {"prompt_tokens": -1, "completion_tokens": True}}, -2.0)
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
    ]
    ledger.turn(episode.assemble_stream(chunks), 0.25)  # a stream's usage, in its last chunk
    cost = ledger.measure()
    assert cost["policy_turns"] == 5
    assert (cost["prompt_tokens"], cost["completion_tokens"]) == (19, 7)
    assert cost["policy_seconds"] == pytest.approx(2.0)
    assert cost["ledger_cpu_seconds"] >= 0

    unknown = episode.Ledger()
    unknown.turn({"choices": []}, 0.1)
    assert unknown.measure()["prompt_tokens"] is None  # turns without usage: not zero tokens
    assert episode.Ledger().measure()["prompt_tokens"] == 0  # no policy at all: zero


def usages(events, key):
    return sum(e["response"]["usage"][key] for e in events if e["event"] == "step")


def test_the_built_in_loops_final_event_carries_the_ledger(tmp_path):
    started = time.time()
    with running(script=SCRIPT) as server:
        done, events = run_runner(tmp_path, TASK, url=server.url)
    assert done.returncode == 0, done.stderr
    cost = events[-1]["cost"]
    assert events[-1]["event"] == "reward" and "cost" not in events[0]
    steps = [e for e in events if e["event"] == "step"]
    assert cost["policy_turns"] == len(steps) == 3
    assert cost["prompt_tokens"] == usages(events, "prompt_tokens") > 0
    assert cost["completion_tokens"] == usages(events, "completion_tokens") > 0
    assert cost["policy_seconds"] == pytest.approx(sum(s["policy_seconds"] for s in steps))
    assert cost["cpu_source"] == "proc" and cost["cpu_seconds"] > 0
    assert cost["cpu_seconds"] == pytest.approx(
        cost["cpu_user_seconds"] + cost["cpu_system_seconds"]
    )
    assert cost["peak_memory_bytes"] > 2**20
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.cost["prompt_tokens"] == cost["prompt_tokens"]
    wall = row.cost["wall"]
    assert wall["agent"] == pytest.approx(
        sum(s["policy_seconds"] + s["action_seconds"] for s in steps)
    )
    assert wall["tests"] == pytest.approx(events[-1]["at"] - steps[-1]["at"])
    assert wall["grader_start"] is None


def test_a_streamed_exchange_through_the_proxy_counts_its_usage(tmp_path):
    handler = type("Handler", (SSEHandler,), {"framing": "chunked", "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done, events = run_runner(tmp_path, agent_task(tmp_path, STREAM_AGENT), url=url)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    cost = events[-1]["cost"]
    # The usage the policy sent in the stream's last chunk (test_agent_command.CHUNKS).
    assert (cost["policy_turns"], cost["prompt_tokens"], cost["completion_tokens"]) == (1, 9, 4)


def test_an_error_ends_with_the_ledger_too(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there
    config = {"model": "m", "max_retries": 0, "request_timeout_seconds": 5}
    _, events = run_runner(tmp_path, TASK, url=f"http://127.0.0.1:{port}", config=config)
    assert events[-1]["event"] == "error"
    cost = events[-1]["cost"]
    # Asked once, never answered: a turn, tokens unknown; the CPU was spent all the same.
    assert cost["policy_turns"] == 1 and cost["prompt_tokens"] is None
    assert cost["cpu_seconds"] > 0


def test_fresh_grading_adds_the_two_sandboxes_ledgers(tmp_path):
    task = TASK | {"grade": "fresh"}
    started = time.time()
    with running(script=SCRIPT) as server:
        first, agent_events = run_runner(tmp_path, task, url=server.url)
    copy = tmp_path / "graded"
    shutil.copytree(tmp_path / "ws", copy)
    second, grade_events = run_runner(
        tmp_path, task, phase="grade", workspace=copy, extra_env=baseline_of(agent_events[-1])
    )
    mine, graders = agent_events[-1]["cost"], grade_events[-1]["cost"]
    assert graders["policy_turns"] == 0 and mine["policy_turns"] == 3
    row = row_of(first.stdout + second.stdout, started)
    assert row.status == "ok", row.errors
    assert row.cost["cpu_seconds"] == pytest.approx(mine["cpu_seconds"] + graders["cpu_seconds"])
    assert row.cost["peak_memory_bytes"] == max(
        mine["peak_memory_bytes"], graders["peak_memory_bytes"]
    )
    assert row.cost["prompt_tokens"] == mine["prompt_tokens"]
    wall = row.cost["wall"]
    assert wall["grader_start"] == pytest.approx(grade_events[0]["at"] - agent_events[-1]["at"])
    assert wall["tests"] == pytest.approx(grade_events[-1]["at"] - grade_events[0]["at"])
    # A grader that never said what it used: the episode's CPU is unknown, not the agent's.
    lines = second.stdout.splitlines()
    reward = json.loads(lines[-1])
    del reward["cost"]
    cut = "\n".join([*lines[:-1], json.dumps(reward)]) + "\n"
    partial = row_of(first.stdout + cut, started)
    assert partial.cost["cpu_seconds"] is None and partial.cost["peak_memory_bytes"] is None
    assert partial.cost["prompt_tokens"] == mine["prompt_tokens"]


# -- validation --------------------------------------------------------------------------------
EP = "rollout-b-0"
IDENTITY = {"task_id": "t", "sample": 0, "group_id": "b:t"}
GOOD = {
    "cpu_seconds": 1.5,
    "cpu_user_seconds": 1.0,
    "cpu_system_seconds": 0.5,
    "peak_memory_bytes": 50_000_000,
    "cpu_source": "proc",
    "policy_turns": 2,
    "prompt_tokens": 120,
    "completion_tokens": 32,
    "policy_seconds": 0.75,
    "ledger_cpu_seconds": 0.001,
}


def logged(cost=None, with_cost=True):
    observation = EpisodeObservation(
        index=0,
        episode_id=EP,
        phase="Succeeded",
        created_at=1001.0,
        finished_at=1006.0,
        exit_code=0,
    )
    events = [
        {"event": "ready", "at": 1002.0, "episode_id": EP, "mode": "agent", **IDENTITY},
        *(
            {
                "event": "step",
                "at": at,
                "episode_id": EP,
                "step": n,
                "actions": [],
                "policy_seconds": wait,
                "action_seconds": act,
                **IDENTITY,
            }
            for n, at, wait, act in ((1, 1003.0, 0.25, 0.5), (2, 1004.0, 0.5, 0.25))
        ),
        {
            "event": "reward",
            "at": 1005.5,
            "episode_id": EP,
            "reward": 1,
            "reward_rule": "all",
            "baseline_exit": 1,
            "tests_exit": 0,
            "steps": 2,
            "stop_reason": "submit",
            **IDENTITY,
            **({"cost": cost} if with_cost else {}),
        },
    ]
    log = "\n".join(json.dumps(e) for e in events) + "\n"
    return validate_episode(observation, log, 1000.0)


def test_validation_copies_the_ledger_and_adds_the_wall_per_phase():
    row = logged(GOOD)
    assert row.status == "ok" and row.errors == []
    assert {k: row.cost[k] for k in GOOD} == GOOD
    assert row.cost["wall"] == {
        "start": 1.0,  # created -> ready
        "agent": 1.5,  # the turns: 0.25 + 0.5 + 0.5 + 0.25
        "grader_start": None,
        "tests": 1.5,  # the last step -> the reward
    }
    assert EpisodeRow.from_dict(json.loads(json.dumps(row.to_dict()))).cost == row.cost


def test_bad_ledger_figures_are_dropped_without_failing_the_episode():
    bad = GOOD | {
        "cpu_seconds": -1,
        "cpu_user_seconds": "3",
        "cpu_system_seconds": True,
        "policy_turns": 2.5,
        "completion_tokens": -3,
        "cpu_source": "guess",
        "extra": "kept out",
    }
    row = logged(bad)
    assert row.status == "ok" and row.errors == []
    for name in (
        "cpu_seconds",
        "cpu_user_seconds",
        "cpu_system_seconds",
        "policy_turns",
        "completion_tokens",
        "cpu_source",
    ):
        assert row.cost[name] is None, name
    assert row.cost["prompt_tokens"] == 120 and row.cost["peak_memory_bytes"] == 50_000_000
    assert "extra" not in row.cost
    assert logged("lots").cost is None and logged("lots").status == "ok"
    # An older runner, without a ledger.
    assert logged(with_cost=False).cost is None


# -- the report ----------------------------------------------------------------------------------
ORIGIN = 1000.0


def two_task_spec(parallelism=2):
    tasks = [
        {"id": "a", "statement": "s", "files": {"a.py": ""}, "test_command": ["python"]},
        {"id": "b", "statement": "s", "files": {"b.py": ""}, "test_command": ["python"]},
    ]
    return parse_spec(
        {
            "tasks": tasks,
            "samples_per_task": 2,
            "parallelism": parallelism,
            "policy": {"url": "http://p:1"},
        },
        max_episodes=100,
    )


def cost_row(spec, index, reward, cost, status="ok", ready=None, finished=None):
    e = spec.episode(index)
    return EpisodeRow(
        index=index,
        pod=f"p-{index}",
        status=status,
        reward=reward,
        task_id=e.task_id,
        sample=e.sample,
        group_id=e.group_id,
        cost=cost,
        ready_at=ready,
        finished_at=finished,
        failure_kind="episode" if status == "failed" else None,
    )


def ledger(cpu, prompt, completion, peak, start=1.0, agent=2.0, tests=0.5):
    return {
        "cpu_seconds": cpu,
        "cpu_user_seconds": cpu * 0.75,
        "cpu_system_seconds": cpu * 0.25,
        "peak_memory_bytes": peak,
        "cpu_source": "proc",
        "policy_turns": 2,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "policy_seconds": 0.5,
        "ledger_cpu_seconds": 0.001,
        "wall": {"start": start, "agent": agent, "grader_start": None, "tests": tests},
    }


def report_of(spec, rows):
    run = RunHandle("local", spec.batch_id, ORIGIN, "p", "local:x")
    return build_report(spec, rows, run, None, finalized_by="test", reported_at=ORIGIN + 60)


def test_the_report_sums_the_ledgers_per_batch_and_group_and_per_reward():
    spec = two_task_spec()
    rows = [
        cost_row(spec, 0, 1, ledger(2.0, 100, 20, 10_000)),
        # A failed episode's CPU and tokens were spent too: they count, its reward does not.
        cost_row(spec, 1, 0, ledger(4.0, 300, 40, 30_000), status="failed"),
        cost_row(spec, 2, 0.5, ledger(1.0, 50, 10, 20_000, tests=None)),
        cost_row(spec, 3, 0.5, None),  # no ledger (an older runner)
    ]
    report = report_of(spec, rows)
    cost = report["cost"]
    assert (cost["ledgers"], cost["episodes"]) == (3, 4)
    assert cost["cpu_seconds"] == pytest.approx(7.0)
    assert cost["cpu_user_seconds"] == pytest.approx(5.25)
    assert cost["peak_memory_bytes"] == 30_000  # the largest, not a sum
    assert (cost["policy_turns"], cost["prompt_tokens"], cost["completion_tokens"]) == (
        6,
        450,
        70,
    )
    assert cost["tokens"] == 520 and cost["policy_seconds"] == pytest.approx(1.5)
    assert cost["wall"] == {"start": 3.0, "agent": 6.0, "grader_start": None, "tests": 1.0}
    assert report["reward_sum"] == 2.0
    assert cost["cpu_seconds_per_reward"] == pytest.approx(3.5)
    assert cost["tokens_per_reward"] == pytest.approx(260)
    a, b = (g["cost"] for g in report["groups"])
    assert (a["ledgers"], a["cpu_seconds"], a["tokens"]) == (2, pytest.approx(6.0), 460)
    assert a["cpu_seconds_per_reward"] == pytest.approx(6.0)  # group a's reward: 1
    assert (b["ledgers"], b["episodes"], b["cpu_seconds"]) == (1, 2, pytest.approx(1.0))
    assert b["tokens_per_reward"] == pytest.approx(60 / 1.0)


def test_cost_per_reward_is_none_without_reward():
    spec = two_task_spec()
    rows = [cost_row(spec, i, 0, ledger(1.0, 10, 5, 1)) for i in range(4)]
    cost = report_of(spec, rows)["cost"]
    assert cost["cpu_seconds"] == pytest.approx(4.0)
    assert cost["cpu_seconds_per_reward"] is None and cost["tokens_per_reward"] is None
    none = report_of(spec, [cost_row(spec, i, 1, None) for i in range(4)])["cost"]
    assert none["ledgers"] == 0 and none["cpu_seconds"] is None and none["tokens"] is None


def test_slot_utilisation_is_busy_time_over_the_slots_there_were():
    assert slot_utilisation([(0, 10), (10, 20), (0, 10), (10, 20)], 2, 0.0) == 1.0
    # Start-up before ready (1 s), a gap (10 -> 12) and an early finish (16 -> 20) are idle.
    spans = [(1, 10), (12, 20), (0, 10), (10, 16)]
    assert slot_utilisation(spans, 2, 0.0) == pytest.approx((9 + 8 + 10 + 6) / 40)
    assert slot_utilisation([], 2, 0.0) is None
    assert slot_utilisation(spans, 0, 0.0) is None
    assert busy_slots([(0, 10), (5, 20), (10, 12)]) == [(0, 1), (5, 2), (10, 2), (12, 1), (20, 0)]


def test_the_report_says_its_slot_utilisation():
    spec = two_task_spec(parallelism=2)
    back_to_back = [(0, 10), (10, 20), (0, 10), (10, 20)]
    rows = [
        cost_row(spec, i, 1, None, ready=ORIGIN + a, finished=ORIGIN + b)
        for i, (a, b) in enumerate(back_to_back)
    ]
    assert report_of(spec, rows)["slot_utilisation"] == 1.0
    gaps = [(1, 10), (12, 20), (0, 10), (10, 16)]
    rows = [
        cost_row(spec, i, 1, None, ready=ORIGIN + a, finished=ORIGIN + b)
        for i, (a, b) in enumerate(gaps)
    ]
    assert report_of(spec, rows)["slot_utilisation"] == pytest.approx(33 / 40)
    # An episode that never got ready did no episode work.
    rows[3] = cost_row(spec, 3, 0, None, status="failed", finished=ORIGIN + 16)
    assert report_of(spec, rows)["slot_utilisation"] == pytest.approx(27 / 40)
    # Kubernetes' finish in whole seconds, cut down below the runner's reward (even below its
    # ready): the span ends at the reward, not dropped or shortened.
    rows[3] = cost_row(spec, 3, 1, None, ready=ORIGIN + 10.4, finished=ORIGIN + 10)
    rows[3].reward_at = ORIGIN + 15.9
    assert report_of(spec, rows)["slot_utilisation"] == pytest.approx((27 + 5.5) / 40)


# -- `rollout report` --------------------------------------------------------------------------
def costed_report():
    spec = two_task_spec()
    spans = [(1, 10), (12, 20), (0, 10), (10, 16)]
    rows = [
        cost_row(spec, i, 1, ledger(1.0 + 3 * (i == 2), 100, 10, 2**21), ready=a, finished=b)
        for i, (a, b) in enumerate((ORIGIN + a, ORIGIN + b) for a, b in spans)
    ]
    return json.loads(json.dumps(report_of(spec, rows)))


def test_rollout_report_prints_a_cost_table_and_the_slot_utilisation():
    data = costed_report()
    tables = {t.title: t for t in summary_tables(data)}
    assert dict(tables["Metrics"].rows)["slot_utilisation"] == f"{33 / 40:.3f}"
    cost = tables["Cost"]
    assert [r[0] for r in cost.rows] == ["batch", "a", "b"]
    batch = dict(zip(cost.header, cost.rows[0], strict=True))
    assert batch["ledgers"] == "4/4" and batch["cpu s"] == "7.000"
    assert batch["peak MiB"] == "2.000" and batch["cpu s / reward"] == f"{7 / 4:.3f}"
    assert dict(zip(cost.header, cost.rows[2], strict=True))["cpu s"] == "5.000"
    assert dict(tables["Sandbox seconds per phase"].rows) == {
        "start": "4.000",
        "agent": "8.000",
        "tests": "2.000",
    }
    assert "## Cost" in render_markdown(data)
    # A report from before the ledger: no cost table at all.
    del data["cost"]
    assert "Cost" not in {t.title for t in summary_tables(data)}


def test_the_plot_has_the_busy_slots_and_the_cpu_per_episode(tmp_path):
    data = costed_report()
    assert busy_spans(data) == [(1, 10), (12, 20), (0, 10), (10, 16)]
    cpu = episode_cpu(data)
    assert [(e.index, e.total, e.user) for e in cpu] == [
        (0, 1.0, 0.75),
        (1, 1.0, 0.75),
        (2, 4.0, 3.0),
        (3, 1.0, 0.75),
    ]
    png = render_timeline(data, tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for row in data["pods"]:
        row.pop("cost")
    assert episode_cpu(data) == []
    assert render_timeline(data, tmp_path / "none.png").exists()
