"""The Kubernetes objects of a pool of sandbox hosts (issue 46), built as plain dicts. Pure:
same `HostPool` in, same objects out; no API call and no Kubernetes client.

A pool is one Deployment of host Pods, each running the host agent
(`python -m rollout_worker.backends.host.agent`) with `slots` bubblewrap sandboxes at once, and
one NetworkPolicy: no ingress; egress only to Redis (and DNS when Redis is named, not numbered)
and to the policy endpoints the pool is given. The Pod is the one docs/sandbox-hosts.md and
tests/k8s/test_sandbox_host.py prove on the real node: its own user namespace, an unmasked
/proc, the Localhost seccomp profile that lets bubblewrap make its namespaces, uid 1000, no
capabilities, no API token. Every object carries the owner label and the pool's name. A pool
may carry task images (`images`): each a read-only Kubernetes image volume under the agent's
--rootfs, with its WORKDIR passed to the agent (an image volume has no image config).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from rollout_wire import constants as k
from rollout_wire.redis_url import is_sentinel, parse_sentinel
from rollout_wire.resources import DEFAULT_STORAGE_LIMIT
from rollout_worker.backends.local.sandbox import rootfs_dirname

# hack/localkube/seccomp/bwrap-host.json, installed under the kubelet's seccomp root.
HOST_SECCOMP_PROFILE = "rollout/bwrap-host.json"
LABEL_HOST_POOL = "rollout.dev/host-pool"
CONTAINER_NAME = "host"
# The scratch volume: an emptyDir (a container restart keeps it, a new Pod starts empty).
HOST_VOLUME = "/var/lib/rollout-host"
# The agent's root (one folder per batch below it), which it wipes, makes and chmods at start: a
# folder of the volume, since uid 1000 may neither chmod nor remove the mount point (root's).
HOST_ROOT = f"{HOST_VOLUME}/root"
HOST_TMP = "/tmp"
# The agent's --rootfs when the pool carries task images: an emptyDir of its own (uid 1000 writes
# each image's WORKDIR file there) with each image volume mounted at <dir>/<rootfs_dirname>.
# Not under HOST_VOLUME: its folders would be made by the runtime as root, and the agent wipes
# its root at start.
HOST_IMAGES = "/var/lib/rollout-images"
IMAGES_SIZE = "1Mi"  # the WORKDIR files only: the images' files are their volumes'
HOST_UID = 1000
# The agent's own share of the Pod, on top of its slots: a Python process with a Redis client
# and the supervisor's bookkeeping.
AGENT_CPU = "250m"
AGENT_MEMORY = "256Mi"
# /tmp holds only the agent's and Python's own small files.
TMP_SIZE = "256Mi"
# Over slots x storage: the per-batch run files and the episodes' logs until they are sent.
ROOT_MARGIN = "256Mi"
REDIS_PORT = 6379
DNS_PORT = 53
# SIGTERM: the agent stops taking and lets running episodes finish; past this they are lost
# and the Celery side's REAP gives them to another host.
TERMINATION_GRACE_SECONDS = 60
# The agent's own grace (--grace) is this much shorter: it kills what still runs and leaves
# cleanly (its leases given back to the list) before the kubelet's SIGKILL.
GRACE_MARGIN_SECONDS = 5

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class Endpoint:
    """A TCP destination host Pods may reach: a CIDR and a port."""

    cidr: str
    port: int


@dataclass(frozen=True)
class TaskImage:
    """A task image the pool's hosts carry (a read-only Kubernetes image volume, KEP-4639):
    `reference` exactly as the tasks name it (`image`), `workdir` its WORKDIR (an image volume
    has no image config: the pool says it; a task's own `workdir` still wins)."""

    reference: str
    workdir: str = "/"
    pull_policy: str = "IfNotPresent"


@dataclass(frozen=True)
class HostPool:
    """One Deployment of host Pods and what each Pod gets."""

    namespace: str
    image: str
    redis_url: str
    slots: int
    replicas: int = 1
    name: str = "rollout-host"
    # Per slot: an episode's limits (rollout_wire.resources.Resources' defaults).
    slot_cpu: str = "500m"
    # What the scheduler reserves per slot (Resources.cpu_request's default): a host is placed
    # as its slots' episode Pods would be, and may burst to its limit.
    slot_cpu_request: str = "100m"
    slot_memory: str = "128Mi"
    slot_storage: str = DEFAULT_STORAGE_LIMIT
    policy_egress: tuple[Endpoint, ...] = ()
    # The URL comes from this Secret's key (name, key) when set: a password stays out of the
    # Deployment; `redis_url` then only shapes the NetworkPolicy.
    redis_secret: tuple[str, str] | None = None
    image_pull_policy: str = "IfNotPresent"
    runtime_class: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, str], ...] = ()
    termination_grace_seconds: int = TERMINATION_GRACE_SECONDS
    # Task images every host of the pool carries: an image task runs only on hosts that do.
    images: tuple[TaskImage, ...] = ()


def pool_labels(pool: HostPool) -> dict[str, str]:
    return {k.LABEL_OWNER: k.LABEL_OWNER_VALUE, LABEL_HOST_POOL: pool.name}


def pool_selector(pool: HostPool) -> str:
    """A label selector for the pool's objects (cleanup, `kubectl get -l`)."""
    return ",".join(f"{key}={value}" for key, value in pool_labels(pool).items())


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity (the forms rollout_wire.resources accepts) as a number."""
    if text.endswith("m"):
        return Decimal(text[:-1]) / 1000
    for suffix, factor in (*_BINARY.items(), *_DECIMAL.items()):
        if text.endswith(suffix):
            return Decimal(text[: -len(suffix)]) * factor
    return Decimal(text)


def millicores(value: Decimal) -> str:
    return f"{int((value * 1000).to_integral_value(rounding='ROUND_CEILING'))}m"


def mebibytes(value: Decimal) -> str:
    return f"{int((value / 2**20).to_integral_value(rounding='ROUND_CEILING'))}Mi"


def pod_limits(pool: HostPool) -> dict[str, str]:
    """slots x an episode's limits, plus the agent's own share: every slot may be full at once.
    Within the Pod only rlimits separate the sandboxes (no cgroup per sandbox)."""
    cpu = pool.slots * quantity(pool.slot_cpu) + quantity(AGENT_CPU)
    memory = pool.slots * quantity(pool.slot_memory) + quantity(AGENT_MEMORY)
    return {"cpu": millicores(cpu), "memory": mebibytes(memory)}


def pod_requests(pool: HostPool) -> dict[str, str]:
    """CPU: slots x an episode's request plus the agent's (as many episode Pods would reserve);
    memory: all of the limit, so the node never overcommits what a full host holds."""
    cpu = pool.slots * quantity(pool.slot_cpu_request) + quantity(AGENT_CPU)
    return {"cpu": millicores(cpu), "memory": pod_limits(pool)["memory"]}


def root_size(pool: HostPool) -> str:
    """The scratch emptyDir's sizeLimit: every slot's disk limit plus a margin."""
    return mebibytes(pool.slots * quantity(pool.slot_storage) + quantity(ROOT_MARGIN))


def agent_command(pool: HostPool) -> list[str]:
    """The agent's command line (its name is the Pod's, from HOSTNAME; Redis from the env)."""
    return [
        "python3",
        "-m",
        "rollout_worker.backends.host.agent",
        "--slots",
        str(pool.slots),
        "--root",
        HOST_ROOT,
        "--grace",
        str(agent_grace(pool)),
        # A slot's size, in the heartbeat: a batch larger than a slot is refused at submit.
        "--slot-memory",
        mebibytes(quantity(pool.slot_memory)),
        "--slot-storage",
        mebibytes(quantity(pool.slot_storage)),
        # The NetworkPolicy's policy endpoints, in the heartbeat: a batch whose policy endpoint
        # is outside them is refused at submit.
        "--policy-egress",
        ",".join(f"{e.cidr}:{e.port}" for e in pool.policy_egress),
        *image_args(pool),
    ]


def image_args(pool: HostPool) -> list[str]:
    """Where the image volumes are (--rootfs) and each one's WORKDIR, which the agent writes
    beside it as `rollout tasks build --rootfs` does: it then tells the images in its
    heartbeat, and its sandboxes find each root as the local backend's do."""
    if not pool.images:
        return []
    args = ["--rootfs", HOST_IMAGES]
    for image in pool.images:
        args += ["--image-workdir", f"{image.reference}={image.workdir}"]
    return args


def image_volume_name(index: int) -> str:
    return f"task-image-{index}"


def image_volumes(pool: HostPool) -> list[dict[str, Any]]:
    if not pool.images:
        return []
    return [
        {"name": "images", "emptyDir": {"sizeLimit": IMAGES_SIZE}},
        *(
            {
                "name": image_volume_name(index),
                "image": {"reference": image.reference, "pullPolicy": image.pull_policy},
            }
            for index, image in enumerate(pool.images)
        ),
    ]


def image_mounts(pool: HostPool) -> list[dict[str, Any]]:
    """The images' folder, then each image read-only inside it (a mount below a mount: listed
    after it). The kubelet mounts image volumes read-only anyway; said here too."""
    if not pool.images:
        return []
    return [
        {"name": "images", "mountPath": HOST_IMAGES},
        *(
            {
                "name": image_volume_name(index),
                "mountPath": f"{HOST_IMAGES}/{rootfs_dirname(image.reference)}",
                "readOnly": True,
            }
            for index, image in enumerate(pool.images)
        ),
    ]


def image_problems(pool: HostPool) -> list[str]:
    """Images the pool cannot carry as given."""
    problems = []
    folders: dict[str, str] = {}
    for image in pool.images:
        if not image.reference or "=" in image.reference:
            problems.append(f"task image {image.reference!r} is not an image reference")
        if not image.workdir.startswith("/"):
            problems.append(f"task image {image.reference}: workdir {image.workdir!r} is relative")
        folder = rootfs_dirname(image.reference)
        if folder in folders:
            problems.append(
                f"task images {folders[folder]} and {image.reference} share the folder {folder}"
            )
        folders[folder] = image.reference
    return problems


def agent_grace(pool: HostPool) -> int:
    """How long a terminated agent lets its episodes run: the Pod's grace less a margin."""
    return max(1, pool.termination_grace_seconds - GRACE_MARGIN_SECONDS)


def redis_env(pool: HostPool) -> dict[str, Any]:
    if pool.redis_secret is None:
        return {"name": "ROLLOUT_REDIS_URL", "value": pool.redis_url}
    name, key = pool.redis_secret
    return {
        "name": "ROLLOUT_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": name, "key": key}},
    }


def host_container(pool: HostPool) -> dict[str, Any]:
    return {
        "name": CONTAINER_NAME,
        "image": pool.image,
        "imagePullPolicy": pool.image_pull_policy,
        "command": agent_command(pool),
        "env": [redis_env(pool), {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "resources": {"requests": pod_requests(pool), "limits": pod_limits(pool)},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "privileged": False,
            # bubblewrap mounts a fresh /proc per sandbox; the kernel refuses it over a /proc
            # with the runtime's masked paths. Allowed only with hostUsers: false.
            "procMount": "Unmasked",
        },
        "volumeMounts": [
            {"name": "root", "mountPath": HOST_VOLUME},
            {"name": "tmp", "mountPath": HOST_TMP},
            *image_mounts(pool),
        ],
    }


def host_pod_spec(pool: HostPool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # The Pod's own user namespace: its root is not the node's (needed for Unmasked).
        "hostUsers": False,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The agent is not PID 1: the pause process reaps what the sandboxes daemonise (a
        # warm pool's process), and the agent never waits on -1 (it would steal the exit
        # codes its Popen objects wait for).
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": pool.termination_grace_seconds,
        "securityContext": {
            "runAsUser": HOST_UID,
            "runAsGroup": HOST_UID,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "Localhost", "localhostProfile": HOST_SECCOMP_PROFILE},
        },
        "containers": [host_container(pool)],
        "volumes": [
            {"name": "root", "emptyDir": {"sizeLimit": root_size(pool)}},
            {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
            *image_volumes(pool),
        ],
    }
    if pool.runtime_class:
        spec["runtimeClassName"] = pool.runtime_class
    if pool.node_selector:
        spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        spec["tolerations"] = [dict(t) for t in pool.tolerations]
    return spec


def deployment_manifest(pool: HostPool) -> dict[str, Any]:
    labels = pool_labels(pool)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": pool.name, "namespace": pool.namespace, "labels": labels},
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": dict(labels)},
            # New hosts start before old ones drain: capacity never drops in a rollout.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {"metadata": {"labels": dict(labels)}, "spec": host_pod_spec(pool)},
        },
    }


def redis_addresses(url: str) -> list[tuple[str, int]]:
    """(host, port) of every server the URL names: the Redis, or each Sentinel."""
    if is_sentinel(url):
        return list(parse_sentinel(url).hosts)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "unix" or not parsed.hostname:
        raise ValueError("host Pods reach Redis over TCP: a unix:// URL names no address")
    return [(parsed.hostname, parsed.port or REDIS_PORT)]


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cidr_of(host: str) -> str:
    address = ipaddress.ip_address(host)
    return f"{address}/{address.max_prefixlen}"


def tcp_rule(port: int, cidr: str | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": port}]}
    if cidr is not None:
        rule["to"] = [{"ipBlock": {"cidr": cidr}}]
    return rule


def redis_egress(url: str) -> list[dict[str, Any]]:
    """Egress to Redis: to its address when the URL holds one; to its port on any address when
    it holds a name (a NetworkPolicy cannot name a host), plus DNS to resolve that name. With
    Sentinel the master is found at run time: its port (6379) is allowed too, and the master
    sits where the Sentinels are when they are numbered."""
    addresses = redis_addresses(url)
    rules = []
    named = False
    for host, port in addresses:
        numbered = is_address(host)
        named = named or not numbered
        rules.append(tcp_rule(port, cidr_of(host) if numbered else None))
        if is_sentinel(url):
            rules.append(tcp_rule(REDIS_PORT, cidr_of(host) if numbered else None))
    if named:
        rules.append(
            {
                "ports": [
                    {"protocol": "UDP", "port": DNS_PORT},
                    {"protocol": "TCP", "port": DNS_PORT},
                ]
            }
        )
    unique: list[dict[str, Any]] = []
    for rule in rules:
        if rule not in unique:
            unique.append(rule)
    return unique


def network_policy_manifest(pool: HostPool) -> dict[str, Any]:
    """No ingress. Egress to Redis and to the configured policy endpoints only: a batch's own
    endpoint cannot be added per batch to a shared host. The agents are given the same list
    (--policy-egress) and tell it in their heartbeats; preflight refuses a batch whose policy
    endpoint (IP and port) is outside a live host's list. The sandboxes themselves have no
    network but their policy socket."""
    egress = redis_egress(pool.redis_url)
    egress += [tcp_rule(e.port, e.cidr) for e in pool.policy_egress]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": pool.name, "namespace": pool.namespace, "labels": pool_labels(pool)},
        "spec": {
            "podSelector": {"matchLabels": pool_labels(pool)},
            "policyTypes": ["Ingress", "Egress"],
            "egress": egress,
        },
    }


def host_objects(pool: HostPool) -> list[dict[str, Any]]:
    """What a pool is, in the order to create it: the policy first, so no host Pod ever runs
    without it."""
    if pool.slots < 1 or pool.replicas < 0:
        raise ValueError("a host pool needs at least one slot per host and replicas >= 0")
    if problems := image_problems(pool):
        raise ValueError("; ".join(problems))
    return [network_policy_manifest(pool), deployment_manifest(pool)]
