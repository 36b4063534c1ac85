"""An episode that writes past its own disk limit (`resources.storage_limit`) is its own
failure: `episode` kind, reward 0, in its group, never retried. A node that ran short of disk
is not the episode's doing: an eviction for the node's pressure stays an infrastructure
failure. The kubelet's messages are its own (pkg/kubelet/eviction/helpers.go)."""

import json

import pytest

from rollout_wire.states import EpisodeStatus, FailureKind
from rollout_worker.backends.kube.read import KubeRunHandle, observe_pods, retryable
from rollout_worker.observation import STORAGE_LIMIT_REASON, EpisodeObservation, own_disk_eviction
from rollout_worker.validation import validate_episode

# The kubelet's eviction messages for the Pod's own limits (emptyDirMessageFmt,
# podEphemeralStorageMessageFmt, containerEphemeralStorageMessageFmt), as it writes them.
OWN = [
    'Usage of EmptyDir volume "workspace" exceeds the limit "64Mi". ',
    "Pod ephemeral local storage usage exceeds the total limit of containers 64Mi. ",
    'Container episode exceeded its local ephemeral storage limit "64Mi". ',
]
# A node-pressure eviction (nodeLowMessageFmt + containerMessageFmt), with its condition.
NODE = (
    "The node was low on resource: ephemeral-storage. Threshold quantity: 1Gi, available: 900Mi. "
    "Container episode was using 70Mi, request is 0, has larger consumption of ephemeral-storage. "
)
DISRUPTION = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}


def evicted_pod(message, *, disrupted=False, exit_code=137):
    conditions = [{"type": "PodScheduled", "lastTransitionTime": "2026-12-06T05:00:01Z"}]
    if disrupted:
        conditions.append(DISRUPTION | {"message": message})
    return {
        "metadata": {
            "name": "rollout-0-a",
            "uid": "a",
            "creationTimestamp": "2026-12-06T05:00:00Z",
        },
        "spec": {"nodeName": "node-a", "restartPolicy": "Never"},
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": message,
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": "episode",
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": exit_code,
                            "reason": "Error",
                            "startedAt": "2026-12-06T05:00:03Z",
                            "finishedAt": "2026-12-06T05:00:20Z",
                        }
                    },
                }
            ],
        },
    }


HANDLE = KubeRunHandle(
    backend="kubernetes",
    batch_id="b",
    origin=0.0,
    episode_prefix="rollout",
    context="c",
    infra_retries=2,
)


@pytest.mark.parametrize("message", OWN)
def test_the_kubelets_own_limit_evictions_are_the_episodes_disk(message):
    reason = own_disk_eviction({"reason": "Evicted", "message": message})
    assert reason == f"{STORAGE_LIMIT_REASON}: {message.strip()}"


def test_a_node_pressure_eviction_or_any_other_end_is_not_the_episodes_disk():
    assert own_disk_eviction({"reason": "Evicted", "message": NODE}) is None
    # Even the own-limit text under a disruption condition is not taken as the episode's.
    status = {"reason": "Evicted", "message": OWN[0], "conditions": [DISRUPTION]}
    assert own_disk_eviction(status) is None
    assert own_disk_eviction({"reason": "DeadlineExceeded", "message": OWN[0]}) is None
    assert own_disk_eviction({"reason": "Evicted"}) is None
    assert own_disk_eviction({"reason": "Evicted", "message": "x " + OWN[1]}) is None


@pytest.mark.parametrize("message", OWN)
def test_a_pod_evicted_for_its_own_disk_ends_its_episode_and_is_never_retried(message):
    pod = evicted_pod(message)
    obs = observe_pods(HANDLE, 0, {"a": pod})
    assert obs.terminal and obs.reason.startswith(STORAGE_LIMIT_REASON)
    assert message.strip() in obs.reason
    assert not retryable(pod, obs) and obs.retried == []


def test_a_pod_evicted_for_the_nodes_pressure_is_retried_within_the_budget():
    pod = evicted_pod(NODE, disrupted=True)
    obs = observe_pods(HANDLE, 0, {"a": pod})
    assert not obs.terminal and obs.reason.startswith("retrying")
    final = observe_pods(HANDLE, 0, {"a": pod}, final=True)
    assert final.reason == "Evicted"


def _log(*events):
    return "".join(json.dumps(e) + "\n" for e in events)


READY = {"event": "ready", "at": 1002.0, "episode_id": "rollout-0-a", "mode": "command"}
IDENTITY = {"task_id": "t", "sample": 0, "group_id": "b:t"}


def _obs(reason):
    return EpisodeObservation(
        index=0,
        episode_id="rollout-0-a",
        phase="Failed",
        created_at=1001.0,
        finished_at=1009.0,
        exit_code=137,
        reason=reason,
    )


def test_an_episode_over_its_disk_limit_is_its_own_failure_with_reward_0():
    reason = own_disk_eviction({"reason": "Evicted", "message": OWN[0]})
    row = validate_episode(_obs(reason), _log(READY | IDENTITY), 1000.0)
    assert row.status == EpisodeStatus.FAILED and row.reward == 0
    assert row.failure_kind == FailureKind.EPISODE
    assert 'Usage of EmptyDir volume "workspace" exceeds the limit "64Mi"' in row.failure_cause
    # Its log may be gone with the evicted Pod's containers (no ready event): still its own.
    assert validate_episode(_obs(reason), "", 1000.0).failure_kind == FailureKind.EPISODE
    # A runner that said "infrastructure" as its disk filled does not make it one either.
    error = {"event": "error", "at": 1003.0, "kind": "infrastructure", "cause": "ENOSPC"}
    both = _log(READY | IDENTITY, error | {"episode_id": "rollout-0-a"} | IDENTITY)
    assert validate_episode(_obs(reason), both, 1000.0).failure_kind == FailureKind.EPISODE


def test_an_eviction_that_is_not_the_episodes_stays_an_infrastructure_failure():
    row = validate_episode(_obs("Evicted"), _log(READY | IDENTITY), 1000.0)
    assert row.status == EpisodeStatus.FAILED and row.failure_kind == FailureKind.INFRASTRUCTURE


# -- the local backend's measurement (local/disk.py) -------------------------------------------


def test_the_local_measurement_counts_each_file_once_and_follows_no_link(tmp_path):
    from rollout_worker.backends.local.disk import disk_use, over_limit

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 2**20)
    episode = tmp_path / "workspace"
    (episode / "deep" / "er").mkdir(parents=True)
    (episode / "deep" / "er" / "data").write_bytes(b"y" * 2**20)
    (episode / "hard").hardlink_to(episode / "deep" / "er" / "data")  # the same blocks
    (episode / "link").symlink_to(outside)  # not the episode's disk
    used, entries = disk_use([episode, tmp_path / "missing"])
    assert 2**20 <= used < 2**20 + 64 * 2**10 and entries == 5
    assert over_limit([episode], 2 * 2**20) is None
    why = over_limit([episode], 2**19)
    assert why is not None and why.startswith(f"{STORAGE_LIMIT_REASON}: ")
    assert "over its storage_limit of 524288 bytes" in why
    # Past the limit the walk stops: what it found is enough.
    assert disk_use([episode, outside], stop_at=10)[0] <= 2 * 2**20


def test_a_sandboxs_file_size_limit_follows_its_disk_limit():
    import subprocess
    import sys

    from rollout_worker.backends.local.sandbox import FILE_SIZE_MARGIN, rlimits

    code = "import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE)[0])"
    limits = rlimits(2**32, 60, 64 * 2**20)
    done = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=limits, capture_output=True, text=True
    )
    assert int(done.stdout) == 64 * 2**20 + FILE_SIZE_MARGIN
