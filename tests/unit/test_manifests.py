import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import parse_spec
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube.objects import (
    INDEX_LABEL,
    job_manifest,
    job_parts,
    namespace_manifest,
)
from rollout_worker.backends.kube.read import (
    DELETED_MARK,
    capacity_plan,
    completion_index,
    observe_pods,
)


def spec(**changes):
    return parse_spec({"count": 10, "backend": "kubernetes", **changes}, max_episodes=100)


def test_job_has_the_guides_shape_and_security():
    job = job_manifest(
        spec(parallelism=4, image="python:3.12-alpine", runtime="cube"),
        ttl_seconds_after_finished=600,
    )
    js = job["spec"]
    assert js["completionMode"] == "Indexed"
    assert (js["completions"], js["parallelism"], js["activeDeadlineSeconds"]) == (10, 4, 240)
    assert js["backoffLimitPerIndex"] == 0 and js["ttlSecondsAfterFinished"] == 600
    assert js["backoffLimit"] == 10  # = count, never reached: one failure per index at most
    pod = js["template"]["spec"]
    assert pod["runtimeClassName"] == "cube" and pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    sc = pod["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"], sc["runAsNonRoot"]) == (
        1000,
        1000,
        1000,
        True,
    )
    (container,) = pod["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # An episode's disk is capped (the kubelet evicts it past the limit), never reserved.
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "64Mi", "ephemeral-storage": "0"},
        "limits": {"cpu": "500m", "memory": "128Mi", "ephemeral-storage": "1Gi"},
    }
    env = {e["name"]: e for e in container["env"]}
    assert env["EPISODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["program"]["configMap"]["name"] == "episode"
    assert volumes["workspace"]["emptyDir"] == {"sizeLimit": "1Gi"}
    labels = job["metadata"]["labels"]
    assert js["template"]["metadata"]["labels"] == labels | {"rollout.dev/first-index": "0"}
    assert labels["rollout.dev/owner"] == "rollout"


def test_every_object_is_labelled_with_owner_and_batch():
    s = spec(batch_id="abc123")
    ns = namespace_manifest(s)
    assert ns["metadata"]["name"] == "rollout-abc123"
    assert ns["metadata"]["labels"] == {
        "rollout.dev/owner": "rollout",
        "rollout.dev/batch": "abc123",
    }


def node(name, cpu="4", memory="8Gi", pods="110", taints=(), labels=None, ready="True"):
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"taints": list(taints)},
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory, "pods": pods},
            "conditions": [{"type": "Ready", "status": ready}],
        },
    }


def test_capacity_counts_runtime_overhead_per_node():
    s = spec(parallelism=10)  # 100m / 64Mi requests
    nodes = [node("a", memory="4Gi"), node("b", memory="4Gi")]
    # Without overhead 64 sandboxes fit per 4Gi node; with 768Mi overhead only 4 (832Mi each).
    fits, text = capacity_plan(s, nodes, [], {"memory": "768Mi"}, {})
    assert fits == 8
    assert "768Mi" in text and "832Mi" in text and "fit 8" in text
    fits, _ = capacity_plan(s, nodes, [], {}, {})
    assert fits == 80


def test_capacity_skips_unschedulable_tainted_and_unselected_nodes_and_subtracts_usage():
    s = spec(parallelism=2, node_selector={"pool": "sandbox"})
    nodes = [
        node("ok", labels={"pool": "sandbox"}, cpu="1"),
        node(
            "tainted",
            labels={"pool": "sandbox"},
            taints=[{"key": "dedicated", "value": "x", "effect": "NoSchedule"}],
        ),
        node("other-pool", labels={"pool": "web"}),
        node("not-ready", labels={"pool": "sandbox"}, ready="False"),
    ]
    busy = [
        {
            "spec": {
                "nodeName": "ok",
                "containers": [{"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}],
            }
        }
    ]
    fits, text = capacity_plan(s, nodes, busy, {}, {})
    assert fits == 5  # (1 - 0.5 cpu) / 100m
    assert "ok:" in text and "tainted" not in text and "other-pool" not in text
    tolerant = spec(
        parallelism=2,
        node_selector={"pool": "sandbox"},
        tolerations=[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    )
    assert capacity_plan(tolerant, nodes, busy, {}, {})[0] == 5 + 40


def pod(name, created, *, phase="Succeeded", exit_code=0, restarts=0, message=None):
    terminated = {
        "exitCode": exit_code,
        "startedAt": "2026-11-30T10:00:03Z",
        "finishedAt": "2026-11-30T10:00:09Z",
        "reason": "Completed",
    }
    if message:
        terminated["message"] = message
    return {
        "metadata": {"name": name, "uid": name, "creationTimestamp": created},
        "spec": {"nodeName": "node-a"},
        "status": {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "lastTransitionTime": "2026-11-30T10:00:01Z"},
                {"type": "Initialized", "lastTransitionTime": "2026-11-30T10:00:02Z"},
            ],
            "containerStatuses": [
                {
                    "name": "episode",
                    "imageID": "sha256:abc",
                    "restartCount": restarts,
                    "state": {"terminated": terminated},
                }
            ],
        },
    }


def test_pod_status_becomes_an_observation_with_phase_timings():
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    obs = observe_pods(
        handle, 3, {"a": pod("rollout-3-x", "2026-11-30T10:00:00Z", message='{"reward": 1}')}
    )
    assert (obs.episode_id, obs.phase, obs.exit_code, obs.node) == (
        "rollout-3-x",
        "Succeeded",
        0,
        "node-a",
    )
    assert obs.image_id == "sha256:abc" and obs.termination_message == '{"reward": 1}'
    assert obs.timing["scheduling_seconds"] == 1.0
    assert obs.timing["container_start_seconds"] == 2.0
    assert obs.finished_at - obs.created_at == 9.0
    # A replaced Pod counts as a restart: the newest Pod is the episode's current attempt.
    replaced = observe_pods(
        handle,
        3,
        {
            "a": pod("rollout-3-x", "2026-11-30T10:00:00Z", phase="Failed", exit_code=137),
            "b": pod("rollout-3-y", "2026-11-30T10:00:05Z"),
        },
    )
    assert replaced.episode_id == "rollout-3-y" and replaced.restart_count == 1
    assert observe_pods(handle, 4, {}).phase == "Pending"


def test_the_cause_of_a_failed_episode_is_the_one_kubernetes_gives():
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    created = "2026-11-30T10:00:00Z"
    # Past activeDeadlineSeconds: the kubelet kills it (container "Error", 137) and says why
    # at the Pod level.
    late = pod("rollout-1-a", created, phase="Failed", exit_code=137)
    late["status"]["reason"] = "DeadlineExceeded"
    late["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "Error"
    assert observe_pods(handle, 1, {"a": late}).reason == "DeadlineExceeded"
    # An image that is not there with pull policy Never: failed now, not at the deadline.
    stuck = pod("rollout-2-a", created, phase="Pending")
    stuck["status"]["containerStatuses"][0]["state"] = {
        "waiting": {"reason": "ErrImageNeverPull", "message": "image not present"}
    }
    obs = observe_pods(handle, 2, {"a": stuck})
    assert obs.terminal and obs.phase == "Failed"
    assert obs.reason == "ErrImageNeverPull: image not present"
    # The same for the agent's init container of a Pod graded apart (its main container waits
    # as PodInitializing, which is no end by itself).
    stuck_init = pod("rollout-4-a", created, phase="Pending")
    stuck_init["status"]["containerStatuses"][0]["state"] = {
        "waiting": {"reason": "PodInitializing"}
    }
    stuck_init["status"]["initContainerStatuses"] = [
        {"name": "agent", "state": {"waiting": {"reason": "ErrImageNeverPull", "message": "x"}}}
    ]
    obs = observe_pods(handle, 4, {"a": stuck_init})
    assert obs.terminal and obs.phase == "Failed" and obs.reason == "ErrImageNeverPull: x"
    # Deleted while it ran.
    gone = pod("rollout-3-a", created, phase="Failed", exit_code=137)
    gone["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:05Z"
    assert "the Pod was deleted" in observe_pods(handle, 3, {"a": gone}).reason
    gone["status"]["phase"] = "Running"
    assert not observe_pods(handle, 3, {"a": gone}).terminal  # wait for its final state


def test_a_pod_the_watch_saw_deleted_before_it_ended_is_a_failed_episode():
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    running = pod("rollout-4-a", "2026-11-30T10:00:00Z", phase="Running")
    running["status"]["containerStatuses"][0]["state"] = {"running": {}}
    obs = observe_pods(handle, 4, {"a": {**running, DELETED_MARK: True}})
    assert obs.terminal and obs.phase == "Failed" and "deleted" in obs.reason


def test_job_index_lists_are_read_as_kubernetes_writes_them():
    from rollout_worker.backends.kube.verdicts import index_in

    assert index_in("1,3-5,9", 4) and index_in("1,3-5,9", 9) and index_in("0", 0)
    assert not index_in("1,3-5,9", 2) and not index_in("", 0)


def test_an_index_its_running_job_counted_failed_has_ended_without_a_pod():
    # A Pod deleted before any watch saw it leaves no Pod to read: the Job's failedIndexes
    # says the episode ended, even while the Job runs on. Waiting for the whole Job to end
    # parked such an episode for up to its deadline.
    from rollout_worker.backends.kube.objects import FIRST_INDEX_LABEL
    from rollout_worker.backends.kube.verdicts import ended_without_pod
    from rollout_worker.observation import EpisodeObservation

    labels = {FIRST_INDEX_LABEL: "10"}
    job = {
        "spec": {"completions": 40, "template": {"metadata": {"labels": labels}}},
        "status": {"failedIndexes": "3,7", "active": 20},
    }
    ended = ended_without_pod([job], 13, EpisodeObservation(13, "p-13", "Pending"))
    assert ended.terminal and ended.phase == "Failed" and "deleted" in (ended.reason or "")
    waiting = ended_without_pod([job], 14, EpisodeObservation(14, "p-14", "Pending"))
    assert not waiting.terminal and waiting.phase == "Pending"
    assert not ended_without_pod([], 13, EpisodeObservation(13, "p-13", "Pending")).terminal


def test_a_retry_budget_counts_only_infrastructure_failures_and_disruptions():
    js = job_manifest(spec(infra_retries=2), ttl_seconds_after_finished=60)["spec"]
    assert js["backoffLimitPerIndex"] == 2
    assert js["backoffLimit"] == 30  # 10 episodes x 3 attempts: never fails the whole Job
    rules = js["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["Count", "Count", "FailIndex", "FailIndex"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    assert rules[1]["onExitCodes"] == {"containerName": "episode", "operator": "In", "values": [4]}
    assert rules[2]["onExitCodes"]["values"] == [0, 4]
    # Without a budget the Job is as before: no policy, one attempt per index.
    plain = job_manifest(spec(), ttl_seconds_after_finished=60)["spec"]
    assert "podFailurePolicy" not in plain and plain["backoffLimitPerIndex"] == 0
    agent = parse_spec(
        {"backend": "kubernetes", "tasks": [TASK], "policy": {"url": "http://10.0.0.1:8000"}},
        max_episodes=100,
    )
    job = job_manifest(agent, ttl_seconds_after_finished=60)
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ROLLOUT_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-index-failure-count']"
    )


TASK = {
    "id": "t",
    "statement": "s",
    "files": {"a.py": ""},
    "test_command": ["python", "-m", "unittest"],
}


def test_earlier_pods_within_the_budget_are_retries_not_restarts():
    handle = KubeRunHandle(
        backend="kubernetes",
        batch_id="b",
        origin=0.0,
        episode_prefix="rollout",
        context="c",
        infra_retries=1,
    )
    created = ["2026-11-30T10:00:00Z", "2026-11-30T10:00:10Z", "2026-11-30T10:00:20Z"]
    down = pod(
        "rollout-0-a",
        created[0],
        phase="Failed",
        exit_code=4,
        message='{"error": true, "kind": "infrastructure", "cause": "policy endpoint answered '
        'HTTP 503"}',
    )
    # The first attempt failed for infrastructure: the Job replaces it, the episode goes on.
    waiting = observe_pods(handle, 0, {"a": down})
    assert not waiting.terminal and waiting.reason.startswith("retrying: policy endpoint")
    # Unless the Job will not (it ended, or counted the index failed).
    assert observe_pods(handle, 0, {"a": down}, final=True).phase == "Failed"
    # The replacement's outcome is the episode's; the first attempt is kept, not a restart.
    obs = observe_pods(handle, 0, {"a": down, "b": pod("rollout-0-b", created[1])})
    assert (obs.episode_id, obs.phase, obs.restart_count) == ("rollout-0-b", "Succeeded", 0)
    assert obs.retried == [
        {
            "episode_id": "rollout-0-a",
            "exit_code": 4,
            "reason": "Completed",
            "cause": "policy endpoint answered HTTP 503",
            "finished_at": obs.finished_at,
        }
    ]
    # The budget spent: a second infrastructure failure ends the episode.
    again = pod("rollout-0-b", created[1], phase="Failed", exit_code=4)
    spent = observe_pods(handle, 0, {"a": down, "b": again})
    assert spent.terminal and spent.phase == "Failed" and len(spent.retried) == 1
    # An episode error is never retried, and a Pod the budget does not explain is a restart.
    broken = pod("rollout-0-c", created[0], phase="Failed", exit_code=3)
    assert observe_pods(handle, 0, {"c": broken}).terminal
    extra = observe_pods(handle, 0, {"c": broken, "b": pod("rollout-0-b", created[1])})
    assert extra.restart_count == 1 and extra.retried == []
    # A disrupted Pod (evicted) uses the budget whatever its exit code.
    evicted = pod("rollout-0-d", created[0], phase="Failed", exit_code=137)
    evicted["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True"})
    assert not observe_pods(handle, 0, {"d": evicted}).terminal


def test_the_runner_and_the_backends_agree_on_the_infrastructure_exit_code():
    from rollout_worker.observation import EXIT_INFRASTRUCTURE
    from tests.runner_program import episode

    assert episode.EXIT_INFRASTRUCTURE == EXIT_INFRASTRUCTURE


def test_a_batch_of_several_images_runs_one_job_per_image_sharing_its_parallelism():
    def task(name, image=None):
        return {"id": name, "statement": "s", "files": {"a.py": ""}, "test_command": ["true"]} | (
            {"image": image} if image else {}
        )

    tasks = [task("a"), task("b", "img/two:1"), task("c"), task("d", "img/two:1"), task("e")]
    s = parse_spec(
        {
            "backend": "kubernetes",
            "tasks": tasks,
            "samples_per_task": 2,
            "parallelism": 5,
            "policy": {"url": "http://10.0.0.1:8000"},
        },
        max_episodes=100,
    )
    # The tasks of an image are grouped, first image first, each image's own order kept.
    assert [t["id"] for t in s.tasks] == ["a", "c", "e", "b", "d"]
    parts = job_parts(s)
    assert [(p.name, p.image, p.first, p.count) for p in parts] == [
        ("rollout", "python:3.12-alpine", 0, 6),
        ("rollout-1", "img/two:1", 6, 4),
    ]
    assert sum(p.parallelism for p in parts) == 5 and all(p.parallelism >= 1 for p in parts)
    second = job_manifest(s, ttl_seconds_after_finished=60, part=parts[1])
    js = second["spec"]
    assert (second["metadata"]["name"], js["completions"], js["maxFailedIndexes"]) == (
        "rollout-1",
        4,
        4,
    )
    template = js["template"]
    assert template["metadata"]["labels"]["rollout.dev/first-index"] == "6"
    container = template["spec"]["containers"][0]
    assert container["image"] == "img/two:1"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ROLLOUT_INDEX_OFFSET"] == "6"
    # Its Pods' episode index is the Job's first index + their completion index.
    pod = {"metadata": {"labels": template["metadata"]["labels"] | {INDEX_LABEL: "3"}}}
    assert completion_index(pod) == 9 and s.episode(9).task_id == "d"
    # One image: one Job, as before.
    assert [p.name for p in job_parts(spec(parallelism=3))] == ["rollout"]


def test_ready_reaches_the_pod_status_through_a_startup_probe_that_never_ends_an_episode():
    s = spec(episode_timeout_seconds=90)
    container = job_manifest(s, ttl_seconds_after_finished=60)["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    probe = container["startupProbe"]
    # The probe looks for the very file the runner is told to create when it says ready.
    assert env["ROLLOUT_READY_FILE"] in " ".join(probe["exec"]["command"])
    # The kubelet kills a container whose startup probe fails failureThreshold times: that must
    # come after the episode's own deadline, so a slow or never-ready episode ends as itself.
    assert probe["failureThreshold"] * probe["periodSeconds"] > s.episode_timeout_seconds
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    running = pod("rollout-3-x", "2026-11-30T10:00:00Z", phase="Running")
    status = running["status"]["containerStatuses"][0]
    status["state"] = {"running": {"startedAt": "2026-11-30T10:00:03Z"}}
    status["started"] = False
    assert observe_pods(handle, 3, {"a": running}).ready is False
    status["started"] = True
    assert observe_pods(handle, 3, {"a": running}).ready is True
    # A Pod that ended is no longer "ready": it is collected.
    assert observe_pods(handle, 3, {"a": pod("rollout-3-x", "2026-11-30T10:00:00Z")}).ready is False


def _exited_pod(exit_code: int, **meta) -> dict:
    return {
        "metadata": {
            "name": "rollout-0-abcde",
            "uid": "u",
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": {INDEX_LABEL: "0"},
            **meta,
        },
        "spec": {"restartPolicy": "Never"},
        "status": {
            "phase": "Running",  # the kubelet holds the phase until the sandbox is torn down
            "containerStatuses": [
                {
                    "name": "episode",
                    "state": {
                        "terminated": {
                            "exitCode": exit_code,
                            "finishedAt": "2026-12-01T10:00:05Z",
                            "message": '{"reward": 1}',
                        }
                    },
                }
            ],
        },
    }


def test_an_episode_ends_when_its_container_exits_not_when_the_pod_phase_follows():
    handle = KubeRunHandle("kubernetes", "b", 0.0, "rollout", "ctx")
    done = observe_pods(handle, 0, {"u": _exited_pod(0)})
    assert (done.phase, done.exit_code, done.termination_message) == (
        "Succeeded",
        0,
        '{"reward": 1}',
    )
    assert observe_pods(handle, 0, {"u": _exited_pod(2)}).phase == "Failed"
    never_seen_running = _exited_pod(0)
    never_seen_running["status"]["phase"] = "Pending"
    assert observe_pods(handle, 0, {"u": never_seen_running}).phase == "Succeeded"
    # Being deleted: wait for its final state (how it ended is the deletion's to say).
    deleting = _exited_pod(0, deletionTimestamp="2026-12-01T10:00:04Z")
    assert observe_pods(handle, 0, {"u": deleting}).phase == "Running"


HIDDEN = {
    "id": "hidden",
    "statement": "Fix calc.py.",
    "files": {"calc.py": "x = 1\n"},
    "tests": {"test.sh": "exit 0  # the hidden check\n"},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
    "agent": {"command": ["python", "-c", "pass"]},
}


def real_spec(tasks):
    return parse_spec(
        {
            "backend": "kubernetes",
            "tasks": tasks,
            "policy": {"url": "http://10.0.0.5:8000"},
            "infra_retries": 1,
        },
        max_episodes=100,
    )


def test_hidden_tests_never_reach_the_agents_container():
    from rollout_worker.backends.kube.objects import configmap_manifest
    from rollout_worker.backends.kube.pod_spec import grades_apart

    batch = real_spec([HIDDEN])
    assert grades_apart(batch)
    pod_spec = job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["template"]["spec"]
    (agent,) = pod_spec["initContainers"]
    (grader,) = pod_spec["containers"]
    assert (agent["name"], grader["name"]) == ("agent", "episode")
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    # The agent's program folder holds the tasks without their tests; no /tests is mounted.
    agent_mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert agent_mounts["/demo"] == "agent-program" and "/tests" not in agent_mounts
    items = volumes["agent-program"]["configMap"]["items"]
    assert {i["key"] for i in items} == {"episode.py", "tasks-agent.json"}
    data = configmap_manifest(batch, "program")["data"]
    assert "the hidden check" in data["tasks.json"]
    assert "the hidden check" not in data["tasks-agent.json"]
    # The agent's runner hands over to the grader, which alone has the tests.
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["ROLLOUT_GRADER"] == "sandbox" and "ROLLOUT_PHASE" not in env
    grader_env = {e["name"]: e.get("value") for e in grader["env"]}
    assert grader_env["ROLLOUT_PHASE"] == "grade"
    assert {m["mountPath"] for m in grader["volumeMounts"]} >= {"/demo", "/tests", "/workspace"}
    assert "startupProbe" in grader and "startupProbe" not in agent
    # Both containers' exit codes count under the retry budget's rules.
    rules = job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["podFailurePolicy"]
    named = {r["onExitCodes"]["containerName"] for r in rules["rules"] if "onExitCodes" in r}
    assert named == {"agent", "episode"}
    # Tasks whose tests are in the task itself, or that run in their own image: one container.
    visible = HIDDEN | {"tests": None, "test_files": {"t.py": "x"}}
    del visible["tests"]
    for tasks in ([visible], [HIDDEN | {"image": "rollout.local/task:1"}]):
        assert not grades_apart(real_spec(tasks))


def test_hidden_tests_of_a_task_in_its_own_image_reach_only_its_runner():
    from rollout_worker.backends.kube.pod_spec import grades_apart, stashes_tests

    batch = real_spec([HIDDEN | {"image": "rollout.local/task:1"}])
    assert not grades_apart(batch) and stashes_tests(batch)
    pod_spec = job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["template"]["spec"]
    (stash,) = pod_spec["initContainers"]
    (episode,) = pod_spec["containers"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    # The episode's container mounts the tasks without their tests, and the stash folder.
    mounts = {m["mountPath"]: m["name"] for m in episode["volumeMounts"]}
    assert mounts["/demo"] == "agent-program" and mounts["/rollout-stash"] == "stash"
    assert {i["key"] for i in volumes["agent-program"]["configMap"]["items"]} == {
        "episode.py",
        "tasks-agent.json",
    }
    env = {e["name"]: e.get("value") for e in episode["env"]}
    assert env["ROLLOUT_HIDDEN_TASKS_FILE"] == "/rollout-stash/tasks.json"
    # The stash copies the full tasks file there, in the task's image, as the sandbox user.
    assert stash["image"] == "rollout.local/task:1" and stash["env"] == []
    assert stash["command"][-3:] == ["/demo/tasks.json", "/rollout-stash/tasks.json", "4"]
    assert {m["name"] for m in stash["volumeMounts"]} == {"program", "stash"}
    assert stash["securityContext"] == episode["securityContext"]
    assert volumes["stash"]["emptyDir"]["medium"] == "Memory"
    rules = job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["podFailurePolicy"]
    named = {r["onExitCodes"]["containerName"] for r in rules["rules"] if "onExitCodes" in r}
    assert named == {"stash", "episode"}
    # No hidden tests: nothing stashed, the program folder as it was.
    visible = {k: v for k, v in HIDDEN.items() if k != "tests"} | {"test_files": {"t.py": "x"}}
    assert not stashes_tests(real_spec([visible | {"image": "rollout.local/task:1"}]))


def test_grade_fresh_on_kubernetes_grades_in_a_second_container_over_the_workspace_alone():
    from rollout_worker.backends.kube.pod_spec import grades_apart

    visible = {k: v for k, v in HIDDEN.items() if k != "tests"} | {
        "test_files": {"t.py": "x"},
        "test_command": ["python", "t.py"],
        "reward": "all",
        "grade": "fresh",
    }
    batch = real_spec([visible])
    assert grades_apart(batch)
    pod_spec = job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["template"]["spec"]
    (agent,) = pod_spec["initContainers"]
    (grader,) = pod_spec["containers"]
    grader_env = {e["name"]: e.get("value") for e in grader["env"]}
    assert grader_env["ROLLOUT_PHASE"] == "grade"
    # Everything the grader shares with the agent's container but the workspace is named, so
    # a fresh grader empties it first.
    shared = set(grader_env["ROLLOUT_SHARED_DIRS"].split(":"))
    volumes = {m["name"] for m in agent["volumeMounts"]}
    both = {m["mountPath"] for m in grader["volumeMounts"] if m["name"] in volumes}
    assert both - shared == {"/workspace", "/handoff"} and "/dev/shm" in shared
    assert {"/tmp", "/logs", "/solution"} <= shared
    # A task in its own image grades `fresh` over a workspace seeded at its workdir
    # (tests/unit/test_fresh_own_image.py), which it must name.
    own_image = visible | {"image": "rollout.local/task:1"}
    with pytest.raises(InvalidSpec, match="in its own image needs its workdir"):
        real_spec([own_image])
    assert grades_apart(real_spec([own_image | {"workdir": "/app"}]))
    assert not grades_apart(real_spec([own_image | {"grade": "same"}]))
    # Beside one graded `same`, a fresh task in the batch's image still grades apart: each
    # Job (one per image) is decided on its own tasks.
    mixed = real_spec([visible | {"id": "fresh"}, own_image | {"id": "own", "grade": "same"}])
    parts = {part.image: part for part in job_parts(mixed)}
    for image, apart in ((mixed.image, True), ("rollout.local/task:1", False)):
        manifest = job_manifest(mixed, ttl_seconds_after_finished=60, part=parts[image])
        names = [c["name"] for c in manifest["spec"]["template"]["spec"].get("initContainers", [])]
        assert names == (["agent"] if apart else []), (image, names)


def test_an_agent_container_that_failed_ends_the_episode_and_both_logs_are_read():
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    failed = pod("rollout-0-x", "2026-11-30T10:00:00Z", phase="Failed")
    status = failed["status"]
    status["initContainerStatuses"] = [
        {
            "name": "agent",
            "state": {
                "terminated": {
                    "exitCode": 4,
                    "startedAt": "2026-11-30T10:00:02Z",
                    "finishedAt": "2026-11-30T10:00:05Z",
                    "message": '{"event": "error"}',
                }
            },
        }
    ]
    status["containerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    obs = observe_pods(handle, 0, {"a": failed})
    assert (obs.phase, obs.exit_code, obs.termination_message) == (
        "Failed",
        4,
        '{"event": "error"}',
    )
    assert obs.log_containers == ["agent", "episode"]
    assert obs.timing["container_started_at"] == obs.created_at + 2


def test_every_container_and_folder_of_an_episode_has_a_bounded_disk():
    """An episode cannot fill its node's disk: each container has an ephemeral-storage limit
    and each emptyDir a sizeLimit (the agent's init container and its folders too)."""
    from rollout_worker.backends.kube.objects import pool_pod_manifest
    from rollout_worker.backends.kube.pod_spec import EPISODE_STORAGE_LIMIT

    batch = real_spec([HIDDEN])
    pods = [
        job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["template"]["spec"],
        job_manifest(spec(), ttl_seconds_after_finished=60)["spec"]["template"]["spec"],
        pool_pod_manifest(spec(image="python:3.12-alpine"), "k", 60)["spec"],
    ]
    for pod in pods:
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["resources"]["limits"]["ephemeral-storage"] == EPISODE_STORAGE_LIMIT
        for volume in pod["volumes"]:
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("sizeLimit"), volume["name"]
    names = {v["name"] for v in pods[0]["volumes"] if "emptyDir" in v}
    assert names >= {"workspace", "tmp", "agent-logs", "agent-tests", "handoff"}


def test_the_batchs_storage_limit_is_every_containers_disk_limit_and_every_disk_folders_size():
    """resources.storage_limit (Harbor's storage_mb, --storage-limit) bounds the episode's
    disk: each container's ephemeral-storage limit (request still 0) and each on-disk
    emptyDir's sizeLimit; memory folders keep their own sizes."""
    from rollout_worker.backends.kube.objects import pool_pod_manifest

    small = {"resources": {"storage_limit": "64Mi"}}
    batch = parse_spec(
        {
            "backend": "kubernetes",
            "tasks": [HIDDEN],
            "policy": {"url": "http://10.0.0.5:8000"},
            **small,
        },
        max_episodes=100,
    )
    pods = [
        job_manifest(batch, ttl_seconds_after_finished=60)["spec"]["template"]["spec"],
        job_manifest(spec(**small), ttl_seconds_after_finished=60)["spec"]["template"]["spec"],
        pool_pod_manifest(spec(image="python:3.12-alpine", **small), "k", 60)["spec"],
    ]
    for pod in pods:
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["resources"]["limits"]["ephemeral-storage"] == "64Mi"
            assert container["resources"]["requests"]["ephemeral-storage"] == "0"
        disk = [v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v]
        assert all(d["sizeLimit"] == "64Mi" for d in disk if d.get("medium") != "Memory")
        assert {d["sizeLimit"] for d in disk if d.get("medium") == "Memory"} <= {
            "16Mi",
            "1Mi",
            "2Mi",
        }
    workspace = next(v for v in pods[0]["volumes"] if v["name"] == "workspace")
    assert workspace["emptyDir"]["sizeLimit"] == "64Mi"


def test_a_warm_pod_whose_containers_all_exited_has_ended_before_its_phase_moves():
    from rollout_worker.backends.kube.verdicts import ended_phase

    def pod(phase, *codes):
        states = [
            {"state": {"terminated": {"exitCode": c}} if c is not None else {}} for c in codes
        ]
        return {"status": {"phase": phase, "containerStatuses": states}}

    assert ended_phase(pod("Running", 0)) == "Succeeded"
    assert ended_phase(pod("Running", 0, 1)) == "Failed"
    assert ended_phase(pod("Running", 0, None)) == "Running"  # one still runs
    assert ended_phase(pod("Failed", 0)) == "Failed"  # the kubelet's word stands
    assert ended_phase({"status": {"phase": "Pending"}}) == "Pending"
