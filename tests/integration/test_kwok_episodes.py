"""Outcomes the tests do not invent (issue 9): batches on KWOK nodes whose episodes either
really run (the episode program in the local sandbox, per Pod) or end by a seeded draw of fates
the pipeline must classify exactly. The harness is tests/integration/kwok_episodes.py; the
stages that end a Pod as it says are in hack/localkube/kwok-stages.yaml.
"""

from __future__ import annotations

import json
import time

import pytest

from rollout_worker.cli.stack import LocalStack
from tests.integration.kwok_episodes import (  # noqa: F401 - fixtures
    FATES,
    SUCCESS,
    Mix,
    classification_problems,
    describe_mix,
    episodes_fixture,
    kube_stack_fixture,
    kwok_request,
    kwok_runtime_fixture,
    new_batch_id,
)
from tests.integration.test_redis_faults import (
    SIGKILL_EPISODES,
    SIGKILL_PARALLELISM,
    every_episode_once_problems,
    sigkill_redis_mid_batch,
)
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.kwok, pytest.mark.redis, pytest.mark.workers]


@pytest.fixture
def rollout(kube_stack):
    kube_stack.check_alive()
    client = RolloutClient(kube_stack.redis_url)
    yield client
    client.close()


def _real_runs(episodes, namespace: str, count: int) -> dict[str, object]:
    """What the harness ran for each Pod of the batch, by Pod name (all of them, really run)."""
    served = kc.wait_for(
        lambda: (s := episodes.served_in(namespace)) and len(s) >= count and s,
        30,
        f"{count} episodes served in {namespace}",
    )
    assert all(s.fate == "episode" and s.run is not None for s in served.values()), served
    return {s.pod: s for s in served.values()}


def test_fix_batch_is_rewarded_by_real_episode_runs(rollout, kwok_runtime, episodes):
    count = 6
    sub = rollout.submit(count=count, parallelism=count, action="fix", **kwok_request(kwok_runtime))
    report = rollout.wait(sub.batch_id, timeout=300)
    print(json.dumps({key: report[key] for key in ("status", "reward_sum", "errors")}))
    assert report["ok"] is True, report["errors"]
    assert report["successful_episodes"] == count and report["reward_sum"] == count
    runs = _real_runs(episodes, report["run"]["namespace"], count)
    for row in report["pods"]:
        run = runs[row["pod"]].run
        events = run.events()
        # The reward in the report is the one this Pod's own run computed and printed.
        assert [e["event"] for e in events] == ["ready", "reward"]
        assert events[1]["episode_id"] == row["pod"] and events[1]["reward"] == 1
        assert (run.exit_code, row["exit_code"]) == (0, 0)
        assert (row["baseline_exit"], row["tests_exit"]) == (1, 0)
        assert row["reward_at"] == events[1]["at"] and row["ready_at"] == events[0]["at"]
        assert json.loads(run.termination_message)["reward"] == 1
        assert row["node"].startswith(kc.KWOK_NODE_PREFIX)


def test_none_batch_fails_by_real_episode_runs(rollout, kwok_runtime, episodes):
    count = 4
    sub = rollout.submit(
        count=count, parallelism=count, action="none", **kwok_request(kwok_runtime)
    )
    report = rollout.wait(sub.batch_id, timeout=300)
    assert report["ok"] is False
    assert report["successful_episodes"] == 0 and report["reward_sum"] == 0
    assert report["failed_episodes"] == count
    runs = _real_runs(episodes, report["run"]["namespace"], count)
    for row in report["pods"]:
        run = runs[row["pod"]].run
        events = run.events()
        assert events[-1]["event"] == "reward" and events[-1]["reward"] == 0, run.entries
        assert run.exit_code == 1
        # Its stdout and stderr both went into the Pod's log, as a kubelet serves them.
        assert {stream for _, stream, _ in run.entries} <= {"stdout", "stderr"}
        assert row["status"] == "failed" and row["reward"] == 0
        assert (row["exit_code"], row["baseline_exit"], row["tests_exit"]) == (1, 1, 1)
        text = "; ".join(row["errors"])
        assert "reward is 0, expected 1" in text, text
        assert "tests_exit is 1 after the action, expected 0" in text, text
        assert "exit code 1, expected 0" in text, text


def test_seeded_mix_is_classified_exactly(rollout, kwok_runtime, episodes):
    """Every fate of the mix (the seed makes each occur) through the whole pipeline: the
    report classifies every episode exactly as drawn. The 1000-episode version is
    test_kubernetes_backend.py::test_one_batch_of_1000_episodes_is_reported_exactly."""
    count, seed = 60, 1
    mix = Mix(seed)
    fates = mix.fates(count)
    assert set(fates) == set(FATES)
    batch_id = new_batch_id()
    episodes.use_mix(batch_id, mix)
    t0 = time.monotonic()
    rollout.submit(batch_id=batch_id, count=count, parallelism=count, **kwok_request(kwok_runtime))
    report = rollout.wait(batch_id, timeout=600)
    print("\n" + describe_mix(report, fates, time.monotonic() - t0))
    problems = classification_problems(report, fates)
    assert not problems, "\n".join(problems)


def test_a_redis_sigkill_mid_batch_loses_no_episode_on_kubernetes(
    k8s_cluster, kwok_runtime, episodes
):
    """tests/integration/test_redis_faults.py's SIGKILL of redis-server mid-batch, on KWOK
    nodes: every episode succeeds (a seeded mix of successes only, so nothing but the crash
    can fail one), and the report holds each exactly once."""
    env = {
        "KUBECONFIG": str(k8s_cluster.kubeconfig),
        "ROLLOUT_COLLECT_BLOCK_SECONDS": "2",
        "ROLLOUT_MAX_BATCH_EPISODES": str(SIGKILL_EPISODES),
    }
    with LocalStack(collectors=2, collect_concurrency=16, aof=True, extra_env=env) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        try:
            batch_id = episodes.use_mix(new_batch_id(), Mix(7, weights=((SUCCESS, 1),)))
            client.submit(
                **kwok_request(
                    kwok_runtime,
                    batch_id=batch_id,
                    count=SIGKILL_EPISODES,
                    parallelism=SIGKILL_PARALLELISM,
                )
            )
            report, given = sigkill_redis_mid_batch(stack, client, batch_id)
            problems = every_episode_once_problems(client, report, SIGKILL_EPISODES, given)
            if problems:
                stack.keep_dir = True  # the workers' and redis-server's logs, for the diagnosis
            assert not problems, f"logs in {stack.dir}:\n" + "\n".join(problems)
            assert all(row["node"].startswith(kc.KWOK_NODE_PREFIX) for row in report["pods"])
        finally:
            client.close()
