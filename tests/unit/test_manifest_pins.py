"""Whole Kubernetes manifests pinned byte for byte (orjson, key order kept: the records a run
saves, job-submitted.json among them, are these bytes): a refactor of `kube/objects.py` must
leave each one as it was. A deliberate manifest change updates the digest here."""

import hashlib

import orjson
import pytest

from rollout_wire.request import parse_spec
from rollout_worker.backends.kube.objects import (
    configmap_manifest,
    job_manifest,
    job_parts,
    namespace_manifest,
    network_policy_manifest,
    pool_configmap_manifest,
    pool_network_policy,
    pool_pod_manifest,
)

HIDDEN = {
    "id": "hidden",
    "statement": "Fix calc.py.",
    "files": {"calc.py": "x = 1\n"},
    "tests": {"test.sh": "exit 0\n"},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
    "agent": {"command": ["python", "-c", "pass"]},
}
VISIBLE = {"id": "v", "statement": "s", "files": {"a.py": ""}, "test_command": ["true"]}


def _spec(**fields):
    return parse_spec({"backend": "kubernetes", **fields}, max_episodes=100)


def _real(tasks, **fields):
    return _spec(tasks=tasks, policy={"url": "http://10.0.0.5:8000"}, **fields)


def _specs():
    fresh = {k: v for k, v in HIDDEN.items() if k != "tests"} | {
        "test_files": {"t.py": "x"},
        "test_command": ["python", "t.py"],
        "reward": "all",
        "grade": "fresh",
    }
    return {
        "demo": _spec(count=10, batch_id="pin-demo"),
        "placed": _spec(
            count=4,
            batch_id="pin-placed",
            node_selector={"pool": "sandbox"},
            tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        ),
        "apart": _real([HIDDEN], infra_retries=1, batch_id="pin-apart"),
        "stash": _real([HIDDEN | {"image": "rollout.local/task:1"}], batch_id="pin-stash"),
        "fresh": _real([fresh], batch_id="pin-fresh"),
        "images": _real(
            [
                VISIBLE,
                VISIBLE | {"id": "b", "image": "img/two:1", "workdir": "/app"},
                VISIBLE | {"id": "c"},
            ],
            samples_per_task=2,
            parallelism=3,
            infra_retries=2,
            batch_id="pin-images",
        ),
    }


def _manifests():
    out = {}
    for name, spec in _specs().items():
        out[f"{name}/namespace"] = namespace_manifest(spec)
        out[f"{name}/configmap"] = configmap_manifest(spec, "PROGRAM")
        out[f"{name}/netpol"] = network_policy_manifest(spec)
        for part in job_parts(spec, {1} if name == "images" else ()):
            out[f"{name}/job/{part.name}"] = job_manifest(
                spec, ttl_seconds_after_finished=60, part=part
            )
    pooled = _real([VISIBLE], image="python:3.12-alpine", batch_id="pin-pool")
    out["pool/pod"] = pool_pod_manifest(pooled, "k", 60)
    out["pool/configmap"] = pool_configmap_manifest("k", "PROGRAM")
    out["pool/netpol"] = pool_network_policy(pooled, "k")
    out["pool/pod-hidden"] = pool_pod_manifest(
        _real([HIDDEN | {"image": "rollout.local/task:1"}]), "k", 60
    )
    return out


def _digest(manifest):
    return hashlib.sha256(orjson.dumps(manifest)).hexdigest()[:16]


PINNED = {
    "apart/configmap": "156084fbe9621213",  # hidden tests: the view says baseline false
    "apart/job/rollout": "13f832652fa66956",
    "apart/namespace": "c85837f155996b39",
    "apart/netpol": "ef5c6eec394e94bd",
    "demo/configmap": "da2b1e467660bb60",
    "demo/job/rollout": "0a287293e0fc72e2",
    "demo/namespace": "f4bf99a58e35d6c0",
    "demo/netpol": "4f556b679a8f7053",
    "fresh/configmap": "1c4bbad69e0fe9e8",
    "fresh/job/rollout": "4cf8da9677102b61",
    "fresh/namespace": "0b09a51956e68bd8",
    "fresh/netpol": "b6be061129cd6900",
    "images/configmap": "67f0cfe8b39021ad",
    "images/job/rollout": "7c75229d72c7716b",
    "images/job/rollout-1": "e39400214d8c3936",
    "images/job/rollout-2": "1960edf8f9e770c8",
    "images/namespace": "73762619dd286954",
    "images/netpol": "7efd4edb7b6d69a5",
    "placed/configmap": "05798597f086d093",
    "placed/job/rollout": "6bb040ba12b43253",
    "placed/namespace": "cb1f821bc0420ed9",
    "placed/netpol": "ce996144e215ddfc",
    "pool/configmap": "27490e95aa9caffd",
    "pool/netpol": "79b1e51cf1810b91",
    "pool/pod": "1531e8522ef23dc2",
    "pool/pod-hidden": "a990aa2561f29336",
    "stash/configmap": "db619be4326354b2",  # hidden tests: the view says baseline false
    "stash/job/rollout": "dd7761d929e3f4db",
    "stash/namespace": "bbd34ccc5b4b46b3",
    "stash/netpol": "213fdde3e3878ade",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_manifest_bytes_are_pinned(name):
    assert _digest(_manifests()[name]) == PINNED[name]


def test_every_pinned_manifest_is_built():
    assert set(_manifests()) == set(PINNED)
