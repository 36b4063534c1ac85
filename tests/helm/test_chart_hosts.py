"""The chart's sandbox hosts (deploy/chart/templates/hosts.yaml), rendered by helm: off by
default, the same Pod as rollout_worker/backends/host/manifests.py builds, a NetworkPolicy with
no ingress and egress only to Redis and the policy endpoints, KEDA on the hosts' work list."""

from __future__ import annotations

import pytest

from rollout_wire import constants as k
from rollout_worker.backends.host import manifests
from tests.helm.conftest import CHART, run_helm
from tests.helm.test_chart_render import by_kind, one

pytestmark = pytest.mark.helm

HOSTS = "rel-rollout-host"


def chart_pod(**fields: object) -> dict:
    """The host Pod manifests.py builds for the release the tests render (`rel`)."""
    pool = manifests.HostPool(
        namespace="rollout",
        image="rollout.local/rollout-worker:host",
        redis_url="redis://rel-rollout-redis:6379/0",
        redis_secret=("rel-rollout-redis-url", "url"),
        **fields,
    )
    return manifests.host_pod_spec(pool)


def test_hosts_are_off_by_default(render):
    objects = render()
    assert not [o for o in objects if o["metadata"]["name"] == HOSTS]


def test_the_host_pod_is_the_one_manifests_builds(render):
    objects = render(
        "hosts.enabled=true",
        "hosts.slots=3",
        "hosts.replicas=5",
        "hosts.terminationGracePeriodSeconds=30",
    )
    deployment = one(objects, "Deployment", HOSTS)
    assert deployment["spec"]["replicas"] == 5
    pod = deployment["spec"]["template"]["spec"]
    built = chart_pod(slots=3, termination_grace_seconds=30)
    for key in (
        "hostUsers",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "shareProcessNamespace",
        "securityContext",
        "volumes",
        "terminationGracePeriodSeconds",
    ):
        assert pod[key] == built[key], key
    assert "serviceAccountName" not in pod and "hostNetwork" not in pod
    (container,) = pod["containers"]
    (want,) = built["containers"]
    for key in ("command", "resources", "securityContext", "volumeMounts", "env"):
        assert container[key] == want[key], key
    assert container["image"] == "rollout.local/rollout-worker:host"
    # The agent's own grace follows the Pod's, 5 s short of it.
    command = container["command"]
    assert command[command.index("--grace") + 1] == "25"
    # The Pods match the Deployment's selector, and the release's Redis lets them in.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    redis_policy = one(objects, "NetworkPolicy", "rel-rollout-redis")
    (allowed,) = redis_policy["spec"]["ingress"][0]["from"]
    assert allowed["podSelector"]["matchLabels"].items() <= labels.items()


def test_host_network_policy_reaches_only_redis_and_the_policy_endpoints(render):
    objects = render(
        "hosts.enabled=true",
        "hosts.policyEgress[0].cidr=10.9.0.0/16",
        "hosts.policyEgress[0].port=8000",
    )
    policy = one(objects, "NetworkPolicy", HOSTS)["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "host"
    assert policy["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in policy
    redis, dns, endpoint = policy["egress"]
    assert redis["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    assert redis["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert dns == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    assert endpoint == {
        "to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    # The agents are told the same list (their heartbeats carry it; preflight checks it).
    (container,) = one(objects, "Deployment", HOSTS)["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--policy-egress") + 1] == "10.9.0.0/16:8000"
    external = render(
        "hosts.enabled=true",
        "redis.enabled=false",
        "externalRedis.url=redis://10.1.2.3:6380/0",
        "hosts.redisEgress[0].cidr=10.1.2.3/32",
        "hosts.redisEgress[0].port=6380",
        "hosts.redisDNS=false",
    )
    (only,) = one(external, "NetworkPolicy", HOSTS)["spec"]["egress"]
    assert only == {
        "to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}],
        "ports": [{"protocol": "TCP", "port": 6380}],
    }


def test_hosts_refuse_what_they_cannot_run_on(helm):
    for sets, message in (
        (["hostNetwork=true"], "needs a Pod network"),
        (["redis.enabled=false", "externalRedis.url=redis://r:6379/0"], "hosts.redisEgress"),
    ):
        args = ["template", "rel", str(CHART), "--set", "hosts.enabled=true"]
        for item in sets:
            args += ["--set", item]
        proc = run_helm(helm, *args, check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_keda_scales_hosts_on_their_work_list(render):
    objects = render("hosts.enabled=true", "hosts.slots=6", "hosts.keda.enabled=true")
    assert "replicas" not in one(objects, "Deployment", HOSTS)["spec"]
    scaled = one(objects, "ScaledObject", HOSTS)
    assert scaled["spec"]["scaleTargetRef"] == {"name": HOSTS}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis"
    # The demand the queue's scripts keep (rollout_worker/backends/host/queue.py): episodes
    # released and not ended, running ones too. Not the work list, which busy hosts that keep
    # up leave empty (KEDA would scale them down).
    assert trigger["metadata"]["listName"] == k.HOSTS_DEMAND_KEY == "rollout:hosts:demand"
    assert trigger["metadata"]["listLength"] == "6"  # one host per `slots` such episodes
    assert trigger["metadata"]["address"] == "rel-rollout-redis.rollout.svc:6379"
    # The collectors' KEDA stays off: the hosts' scaler stands alone.
    assert [o["metadata"]["name"] for o in by_kind(objects, "ScaledObject")] == [HOSTS]
    with_password = render(
        "hosts.enabled=true", "hosts.keda.enabled=true", "keda.passwordSecret=redis-pw"
    )
    auth = one(with_password, "TriggerAuthentication", HOSTS)
    assert auth["spec"]["secretTargetRef"][0]["name"] == "redis-pw"
    (trigger,) = one(with_password, "ScaledObject", HOSTS)["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": HOSTS}


def test_the_hosts_task_images_are_the_image_volumes_manifests_builds(render):
    objects = render(
        "hosts.enabled=true",
        "hosts.slots=3",
        "hosts.terminationGracePeriodSeconds=30",
        "hosts.images[0].reference=rollout.local/harbor-task:1",
        "hosts.images[0].workdir=/app",
        "hosts.images[1].reference=registry.example/team/env:2",
        "hosts.images[1].pullPolicy=Never",
    )
    pod = one(objects, "Deployment", HOSTS)["spec"]["template"]["spec"]
    built = chart_pod(
        slots=3,
        termination_grace_seconds=30,
        images=(
            manifests.TaskImage("rollout.local/harbor-task:1", "/app"),
            manifests.TaskImage("registry.example/team/env:2", pull_policy="Never"),
        ),
    )
    assert pod["volumes"] == built["volumes"]
    (container,) = pod["containers"]
    (want,) = built["containers"]
    for key in ("command", "volumeMounts"):
        assert container[key] == want[key], key
    # Without images: no image volume and no --rootfs (the Pod of the test above).
    plain = one(render("hosts.enabled=true"), "Deployment", HOSTS)["spec"]["template"]["spec"]
    assert all("image" not in v for v in plain["volumes"])
    assert "--rootfs" not in plain["containers"][0]["command"]
