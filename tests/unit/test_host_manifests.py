"""The host pool's objects (rollout_worker/backends/host/manifests.py): the Pod that
tests/k8s/test_sandbox_host.py proves can run bubblewrap, sized by its slots, and a
NetworkPolicy that lets it reach only Redis and the configured policy endpoints."""

from pathlib import Path

import pytest

from rollout_worker.backends.host import agent
from rollout_worker.backends.host.manifests import (
    HOST_IMAGES,
    HOST_ROOT,
    HOST_SECCOMP_PROFILE,
    HOST_VOLUME,
    Endpoint,
    HostPool,
    TaskImage,
    host_objects,
    pool_selector,
    redis_egress,
)


def pool(**changes):
    fields = {
        "namespace": "hosts",
        "image": "rollout.local/rollout-worker:kube",
        "redis_url": "redis://10.1.2.3:6380/0",
        "slots": 3,
        "replicas": 2,
    }
    return HostPool(**(fields | changes))


def test_the_pod_has_every_field_bubblewrap_needs_and_nothing_more():
    policy, deployment = host_objects(pool())
    assert (policy["kind"], deployment["kind"]) == ("NetworkPolicy", "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["hostUsers"] is False
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["shareProcessNamespace"] is True  # daemonised children get reaped
    assert spec["securityContext"] == {
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "Localhost", "localhostProfile": HOST_SECCOMP_PROFILE},
    }
    assert HOST_SECCOMP_PROFILE == "rollout/bwrap-host.json"
    (container,) = spec["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "procMount": "Unmasked",
    }
    assert "serviceAccountName" not in spec and "hostNetwork" not in spec
    assert container["command"] == [
        "python3",
        "-m",
        "rollout_worker.backends.host.agent",
        "--slots",
        "3",
        "--root",
        HOST_ROOT,
        "--grace",
        "55",  # the Pod's 60 s less 5: the agent leaves before the kubelet's SIGKILL
        *("--slot-memory", "128Mi", "--slot-storage", "1024Mi"),  # in its heartbeat
        *("--policy-egress", ""),  # no policy endpoint: in its heartbeat, refused at submit
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["ROLLOUT_REDIS_URL"] == {
        "name": "ROLLOUT_REDIS_URL",
        "value": "redis://10.1.2.3:6380/0",
    }


def test_limits_are_slots_times_an_episode_plus_the_agent():
    (_, deployment) = host_objects(pool(slots=3))
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # 3 x (500m, 128Mi) + the agent's (250m, 256Mi); CPU requested as 3 episode Pods would
    # (100m each) + the agent, memory all of it.
    assert container["resources"] == {
        "requests": {"cpu": "550m", "memory": "640Mi"},
        "limits": {"cpu": "1750m", "memory": "640Mi"},
    }
    volumes = {v["name"]: v["emptyDir"] for v in spec["volumes"]}
    # 3 x 1Gi of episode disk + 256Mi of margin.
    assert volumes == {"root": {"sizeLimit": "3328Mi"}, "tmp": {"sizeLimit": "256Mi"}}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"root": HOST_VOLUME, "tmp": "/tmp"}
    # The agent's root is a folder of the volume: it may chmod and wipe that, not the mount.
    assert HOST_ROOT.startswith(HOST_VOLUME + "/")

    bigger = pool(slots=2, slot_cpu="1", slot_memory="1Gi", slot_storage="500M")
    (container,) = host_objects(bigger)[1]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"cpu": "2250m", "memory": "2304Mi"}


def test_every_object_is_labelled_and_the_deployment_selects_its_pods():
    objects = host_objects(pool(name="hosts-a"))
    labels = {"rollout.dev/owner": "rollout", "rollout.dev/host-pool": "hosts-a"}
    for obj in objects:
        assert obj["metadata"]["labels"] == labels
        assert obj["metadata"]["namespace"] == "hosts"
    deployment = objects[1]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"] == {"matchLabels": labels}
    assert deployment["spec"]["template"]["metadata"]["labels"] == labels
    assert objects[0]["spec"]["podSelector"] == {"matchLabels": labels}
    assert pool_selector(pool(name="hosts-a")) == (
        "rollout.dev/owner=rollout,rollout.dev/host-pool=hosts-a"
    )


def test_placement_and_a_secret_url_reach_the_pod():
    secret = pool(
        redis_secret=("rollout-redis", "url"),
        runtime_class="runc",
        node_selector={"rollout.dev/real-node": "true"},
        tolerations=({"key": "rollout.dev/real-node", "operator": "Exists"},),
        image_pull_policy="Never",
    )
    spec = host_objects(secret)[1]["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "runc"
    assert spec["nodeSelector"] == {"rollout.dev/real-node": "true"}
    assert spec["tolerations"] == [{"key": "rollout.dev/real-node", "operator": "Exists"}]
    (container,) = spec["containers"]
    assert container["imagePullPolicy"] == "Never"
    (url,) = [e for e in container["env"] if e["name"] == "ROLLOUT_REDIS_URL"]
    # The password stays in the Secret: the Deployment holds only its name.
    assert url == {
        "name": "ROLLOUT_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "rollout-redis", "key": "url"}},
    }
    assert "runtimeClassName" not in host_objects(pool())[1]["spec"]["template"]["spec"]


def test_network_policy_allows_only_redis_and_the_policy_endpoints():
    endpoints = (Endpoint("10.9.0.0/16", 8000), Endpoint("192.168.1.5/32", 443))
    policy = host_objects(pool(policy_egress=endpoints))[0]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in policy["spec"]  # no ingress at all
    assert policy["spec"]["egress"] == [
        {
            "to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}],
            "ports": [{"protocol": "TCP", "port": 6380}],
        },
        {
            "to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}],
            "ports": [{"protocol": "TCP", "port": 8000}],
        },
        {
            "to": [{"ipBlock": {"cidr": "192.168.1.5/32"}}],
            "ports": [{"protocol": "TCP", "port": 443}],
        },
    ]
    # The agents are told the same list: their heartbeats carry it, preflight checks it.
    command = host_objects(pool(policy_egress=endpoints))[1]["spec"]["template"]["spec"][
        "containers"
    ][0]["command"]
    told = command[command.index("--policy-egress") + 1]
    assert told == "10.9.0.0/16:8000,192.168.1.5/32:443"
    assert agent.parse(["--redis-url", "redis://x", "--policy-egress", told]).policy_egress == [
        {"cidr": "10.9.0.0/16", "port": 8000},
        {"cidr": "192.168.1.5/32", "port": 443},
    ]
    assert agent.parse(["--redis-url", "redis://x", "--policy-egress", ""]).policy_egress == []
    assert agent.parse(["--redis-url", "redis://x"]).policy_egress is None


def test_dns_only_when_redis_is_a_name():
    assert all(
        rule["ports"][0]["protocol"] == "TCP" for rule in redis_egress("rediss://:pw@10.0.0.7:6379")
    )
    named = redis_egress("redis://:pw@rollout-redis.rollout.svc:6379/0")
    # A NetworkPolicy cannot name a host: the port on any address, and DNS to resolve it.
    assert named == [
        {"ports": [{"protocol": "TCP", "port": 6379}]},
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
    ]
    sentinel = redis_egress("sentinel://10.0.0.1:26379,10.0.0.2/0?master=m")
    assert sentinel == [
        {
            "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
            "ports": [{"protocol": "TCP", "port": 26379}],
        },
        {
            "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
            "ports": [{"protocol": "TCP", "port": 6379}],
        },
        {
            "to": [{"ipBlock": {"cidr": "10.0.0.2/32"}}],
            "ports": [{"protocol": "TCP", "port": 26379}],
        },
        {
            "to": [{"ipBlock": {"cidr": "10.0.0.2/32"}}],
            "ports": [{"protocol": "TCP", "port": 6379}],
        },
    ]
    ipv6 = redis_egress("redis://[fd00::5]:6379/0")
    assert ipv6 == [
        {"to": [{"ipBlock": {"cidr": "fd00::5/128"}}], "ports": [{"protocol": "TCP", "port": 6379}]}
    ]


def test_pools_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="slot"):
        host_objects(pool(slots=0))
    with pytest.raises(ValueError, match="unix"):
        host_objects(pool(redis_url="unix:///run/redis.sock"))


def test_a_pool_carries_task_images_as_read_only_image_volumes_beside_their_workdirs():
    images = (
        TaskImage("rollout.local/harbor-task:1", "/app"),
        TaskImage("registry.example/team/env@sha256:" + "a" * 64, pull_policy="Never"),
    )
    bare_policy, bare = host_objects(pool(name="hosts-a"))
    policy, deployment = host_objects(pool(name="hosts-a", images=images))
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # Each image a Kubernetes image volume (KEP-4639) with its pull policy, after an emptyDir
    # of its own for the WORKDIR files the agent writes (uid 1000 may write there).
    assert spec["volumes"][2:] == [
        {"name": "images", "emptyDir": {"sizeLimit": "1Mi"}},
        {
            "name": "task-image-0",
            "image": {"reference": "rollout.local/harbor-task:1", "pullPolicy": "IfNotPresent"},
        },
        {
            "name": "task-image-1",
            "image": {"reference": images[1].reference, "pullPolicy": "Never"},
        },
    ]
    # ...mounted read-only where the agent's --rootfs finds it: <dir>/<rootfs_dirname(image)>.
    assert container["volumeMounts"][2:] == [
        {"name": "images", "mountPath": HOST_IMAGES},
        {
            "name": "task-image-0",
            "mountPath": f"{HOST_IMAGES}/rollout.local_harbor-task_1",
            "readOnly": True,
        },
        {
            "name": "task-image-1",
            "mountPath": f"{HOST_IMAGES}/registry.example_team_env_sha256_{'a' * 64}",
            "readOnly": True,
        },
    ]
    # The agent is told where they are and each one's WORKDIR (an image volume has no config).
    command = container["command"]
    assert command[len(bare["spec"]["template"]["spec"]["containers"][0]["command"]) :] == [
        *("--rootfs", HOST_IMAGES),
        *("--image-workdir", "rollout.local/harbor-task:1=/app"),
        *("--image-workdir", f"{images[1].reference}=/"),
    ]
    parsed = agent.parse(["--redis-url", "redis://x", *command[command.index("--rootfs") :]])
    assert parsed.rootfs == Path(HOST_IMAGES)
    assert parsed.image_workdir == [(i.reference, i.workdir) for i in images]
    # Nothing else changes: labels, policy, security, the pool's own volumes.
    assert policy == bare_policy
    assert deployment["metadata"] == bare["metadata"]
    assert deployment["spec"]["template"]["metadata"] == bare["spec"]["template"]["metadata"]
    bare_spec = bare["spec"]["template"]["spec"]
    assert spec["volumes"][:2] == bare_spec["volumes"]
    assert container["volumeMounts"][:2] == bare_spec["containers"][0]["volumeMounts"]
    assert container["securityContext"] == bare_spec["containers"][0]["securityContext"]
    assert {k: v for k, v in spec.items() if k not in ("volumes", "containers")} == {
        k: v for k, v in bare_spec.items() if k not in ("volumes", "containers")
    }
    # A pool without images has no image volume nor image arguments at all.
    assert "--rootfs" not in bare_spec["containers"][0]["command"]
    assert all("image" not in v for v in bare_spec["volumes"])


def test_task_images_a_pool_cannot_carry_are_refused():
    with pytest.raises(ValueError, match="workdir 'app' is relative"):
        host_objects(pool(images=(TaskImage("a/b:1", "app"),)))
    # Two references that would share one folder under --rootfs.
    with pytest.raises(ValueError, match="share the folder a_b_1"):
        host_objects(pool(images=(TaskImage("a/b:1"), TaskImage("a/b_1"))))
    with pytest.raises(ValueError, match="not an image reference"):
        host_objects(pool(images=(TaskImage("a=b"),)))
