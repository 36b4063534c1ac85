"""Failures that really happen, on the real node, through the whole pipeline: a trainer's
batch (trainer_stub.client.RolloutClient) -> Redis -> Celery workers -> the API server -> the
kubelet, containerd and runc -> back into the report.

Each batch is small and its deadlines short. Whatever goes wrong, the batch must finish: one
report, every episode in it exactly once (one row and one stream entry per index), the failed
episodes with reward 0 and their cause in the row and in the report's errors, and no episode
waiting past the batch deadline.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

#: The Job controller's label on each Pod of an Indexed Job.
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
#: Slack on "by the deadline": Kubernetes timestamps have 1 s resolution, the kubelet checks
#: active deadlines on its sync loop, and collectors look again every few seconds.
DEADLINE_SLACK_S = 10
#: After the batch deadline, how long a report may take (collection grace + records + cleanup).
REPORT_WAIT_EXTRA_S = 120


@pytest.fixture
def rollout(real_stack):
    real_stack.check_alive()
    client = RolloutClient(real_stack.redis_url)
    yield client
    client.close()


def _request(real_node: kc.RealNode, **fields: Any) -> dict[str, Any]:
    return {"backend": "kubernetes", **real_node.batch_fields(), **fields}


def _follow(rollout: RolloutClient, batch_id: str, timeout: float) -> tuple[dict, Counter]:
    """Read the batch's stream until its report; return the report and how many episode
    entries each index got (each must get exactly one)."""
    entries: Counter = Counter()
    for _, entry in rollout.entries([batch_id], timeout=timeout):
        if entry.row is not None:
            entries[entry.index] += 1
    report = rollout.report(batch_id)
    assert report is not None, f"stream of {batch_id} ended without a stored report"
    return report, entries


def _show(name: str, report: dict) -> None:
    print(
        f"\n{name}: status={report['status']} episodes={report['episodes']} "
        f"ok/failed/lost={report['successful_episodes']}/{report['failed_episodes']}/"
        f"{report['lost_episodes']} reward_sum={report['reward_sum']}"
    )
    for row in report["pods"]:
        print(f"  episode {row['index']} {row['pod']} {row['status']}: {row['errors']}")


def _assert_finished_exactly_once(report: dict, entries: Counter, count: int) -> list[dict]:
    """The batch finished and counted every episode once; returns its rows by index."""
    assert report["status"] in ("succeeded", "failed"), report["status"]
    assert report["episodes"] == count
    assert report["collected_episodes"] == count, report["errors"]
    indexes = [row["index"] for row in report["pods"]]
    assert sorted(indexes) == list(range(count)), indexes
    assert dict(entries) == dict.fromkeys(range(count), 1), f"stream entries per index {entries}"
    assert (
        report["successful_episodes"] + report["failed_episodes"] + report["lost_episodes"] == count
    )
    ok_rows = [row for row in report["pods"] if row["status"] == "ok"]
    assert report["reward_sum"] == sum(row["reward"] for row in ok_rows)
    for row in report["pods"]:
        if row["status"] != "ok":
            assert row["reward"] == 0, row
            assert row["errors"], f"episode {row['index']} failed without a cause: {row}"
            # The report's own error list names it too.
            assert any(e.startswith(f"episode {row['index']} ") for e in report["errors"]), report[
                "errors"
            ]
    return sorted(report["pods"], key=lambda r: r["index"])


def _ended_by(row: dict, report: dict, limit: float, what: str) -> list[str]:
    """Problems if the episode's row was collected later than ``limit`` seconds (+ slack) after
    the run started."""
    if row["collected_at"] is None:
        return [f"episode {row['index']}: no collected_at"]
    late = row["collected_at"] - report["run_created_at"]
    print(f"  episode {row['index']} collected {late:.1f}s after the run started ({what} {limit}s)")
    if late > limit + DEADLINE_SLACK_S:
        return [
            f"episode {row['index']} collected {late:.1f}s after the run started; {what} is "
            f"{limit}s (+{DEADLINE_SLACK_S}s slack)"
        ]
    return []


def _names(row: dict, needle: str, what: str) -> list[str]:
    text = "; ".join(row["errors"])
    if needle.lower() in text.lower():
        return []
    return [f"episode {row['index']} ({row['pod']}): {what} not named; its errors: {text}"]


def _no_spurious_log_errors(row: dict) -> list[str]:
    # The episode program's own stderr diagnostic is not a corrupt log.
    return [
        f"episode {row['index']}: spurious error {e!r} (the Pod log merges the program's "
        "stderr into its stdout events)"
        for e in row["errors"]
        if "is not a JSON event" in e
    ]


def test_tests_still_failing_after_the_action(rollout, real_node):
    """Action `none`: the bug stays, the tests still fail, reward 0, the episode fails with
    its cause (the reward event's numbers)."""
    count = 2
    sub = rollout.submit(
        **_request(real_node, count=count, parallelism=count, action="none", deadline_seconds=120)
    )
    report, entries = _follow(rollout, sub.batch_id, 120 + REPORT_WAIT_EXTRA_S)
    _show("action none", report)
    rows = _assert_finished_exactly_once(report, entries, count)
    assert report["ok"] is False and report["status"] == "failed"
    assert report["successful_episodes"] == 0 and report["reward_sum"] == 0
    assert report["failed_episodes"] == count
    logs = rollout.logs(sub.batch_id)
    problems: list[str] = []
    for row in rows:
        assert row["status"] == "failed"
        assert row["node"] == real_node.name
        # The episode really ran: both events, the tests failed before and after the action.
        assert (row["baseline_exit"], row["tests_exit"], row["exit_code"]) == (1, 1, 1), row
        assert row["phase"] == "Failed"
        events = [
            json.loads(line) for line in logs[row["index"]].splitlines() if line.startswith("{")
        ]
        assert [e["event"] for e in events] == ["ready", "reward"]
        assert events[1]["reward"] == 0
        problems += _names(row, "reward is 0, expected 1", "the reward")
        problems += _names(row, "tests_exit is 1 after the action, expected 0", "tests_exit")
        problems += _no_spurious_log_errors(row)
    assert not problems, "\n".join(problems)


def test_image_that_is_not_there_with_pull_policy_never(rollout, real_node):
    """An image the node does not hold, pull policy Never: the kubelet reports
    ErrImageNeverPull and never starts the container. The batch must end by its deadline, each
    episode failed with that cause, not hang."""
    count, deadline, episode_timeout = 2, 30, 15
    sub = rollout.submit(
        **_request(
            real_node,
            count=count,
            parallelism=count,
            image="rollout.local/not-there:1",
            image_pull_policy="Never",
            deadline_seconds=deadline,
            episode_timeout_seconds=episode_timeout,
        )
    )
    t0 = time.monotonic()
    report, entries = _follow(rollout, sub.batch_id, deadline + REPORT_WAIT_EXTRA_S)
    print(f"image not there: report after {time.monotonic() - t0:.1f}s (deadline {deadline}s)")
    _show("image not there", report)
    rows = _assert_finished_exactly_once(report, entries, count)
    assert report["ok"] is False and report["successful_episodes"] == 0
    problems: list[str] = []
    for row in rows:
        assert row["status"] in ("failed", "lost"), row
        problems += _ended_by(row, report, deadline, "the batch deadline")
        problems += _names(row, "ErrImageNeverPull", "the cause ErrImageNeverPull")
    assert not problems, "\n".join(problems)


def test_episode_past_its_deadline(rollout, real_node):
    """Action `hang` with a short episode timeout: the kubelet ends each episode at its active
    deadline (Pod reason DeadlineExceeded), before the batch deadline."""
    count, deadline, episode_timeout = 2, 60, 10
    sub = rollout.submit(
        **_request(
            real_node,
            count=count,
            parallelism=count,
            action="hang",
            deadline_seconds=deadline,
            episode_timeout_seconds=episode_timeout,
        )
    )
    report, entries = _follow(rollout, sub.batch_id, deadline + REPORT_WAIT_EXTRA_S)
    _show("action hang", report)
    rows = _assert_finished_exactly_once(report, entries, count)
    assert report["ok"] is False and report["successful_episodes"] == 0
    problems: list[str] = []
    for row in rows:
        assert row["status"] in ("failed", "lost"), row
        assert row["node"] == real_node.name
        # It really started: the ready event is in its log, the reward never came.
        assert row["ready_at"] is not None and row["reward_at"] is None, row
        assert row["collected_at"] - report["run_created_at"] >= episode_timeout - 1, row
        problems += _names(row, "DeadlineExceeded", "the cause DeadlineExceeded")
        problems += _ended_by(row, report, deadline, "the batch deadline")
        problems += _ended_by(row, report, episode_timeout, "the episode timeout")
    assert not problems, "\n".join(problems)


def test_pod_deleted_while_it_runs(rollout, real_node, k8s_cluster):
    """One batch Pod is deleted through the API while its episode runs. The batch still
    finishes; that episode is reported once, failed, with the deletion as its cause."""
    count, deadline, episode_timeout = 3, 90, 25
    sub = rollout.submit(
        **_request(
            real_node,
            count=count,
            parallelism=count,
            action="hang",
            deadline_seconds=deadline,
            episode_timeout_seconds=episode_timeout,
        )
    )
    namespace = kc.wait_for(
        lambda: rollout.receipt(sub.batch_id).get("namespace"), 60, "the batch's namespace"
    )

    def running_pod():
        pods = k8s_cluster.core.list_namespaced_pod(namespace).items
        for pod in sorted(pods, key=lambda p: p.metadata.labels.get(INDEX_LABEL, "")):
            for status in pod.status.container_statuses or []:
                if status.state and status.state.running:
                    return pod
        return None

    victim = kc.wait_for(running_pod, 60, f"a running episode Pod in {namespace}", interval=0.5)
    victim_index = int(victim.metadata.labels[INDEX_LABEL])
    try:
        k8s_cluster.core.delete_namespaced_pod(victim.metadata.name, namespace)
    except ApiException as exc:
        pytest.fail(f"could not delete {namespace}/{victim.metadata.name}: {exc}")
    print(f"\ndeleted {namespace}/{victim.metadata.name} (index {victim_index}) while running")

    report, entries = _follow(rollout, sub.batch_id, deadline + REPORT_WAIT_EXTRA_S)
    _show("pod deleted", report)
    rows = _assert_finished_exactly_once(report, entries, count)
    assert report["ok"] is False and report["successful_episodes"] == 0
    deleted = rows[victim_index]
    assert deleted["status"] in ("failed", "lost"), deleted
    assert deleted["pod"] == victim.metadata.name, (deleted["pod"], victim.metadata.name)
    problems = _names(deleted, "delet", "its deletion")
    problems += _ended_by(deleted, report, deadline, "the batch deadline")
    for row in rows:
        if row["index"] != victim_index:
            problems += _ended_by(row, report, deadline, "the batch deadline")
    assert not problems, "\n".join(problems)
