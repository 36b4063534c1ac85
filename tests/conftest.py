"""Shared fixtures. Tests that need Redis, workers or a cluster start real ones: a missing
redis-server or cluster is a failure, never a skip.

Kubernetes (logic in tests/k8s/cluster.py):
- ``k8s_cluster`` (session): ``$KUBECONFIG`` if it answers, else the local cluster from
  ``hack/localkube/cluster.sh up`` (torn down at session end only if started here).
- ``k8s_namespace`` (function): a fresh namespace labelled ``rollout.dev/test=true``.
- ``kwok_nodes`` (session): names of Ready KWOK nodes (created if missing).
- ``kwok_logs`` (function): factory making a simulated Pod log served through the API server.
"""

from __future__ import annotations

import os

import pytest

from rollout_worker.stack import LocalStack
from tests.k8s import cluster as kc
from tests.k8s.node_fixtures import real_node  # noqa: F401 - a fixture
from trainer_stub.client import RolloutClient


@pytest.fixture(scope="session")
def stack():
    """A private redis-server, one `control` worker and two `collect` workers (real processes)."""
    with LocalStack(collectors=2, extra_env={"ROLLOUT_MAX_BATCH_EPISODES": "300"}) as running:
        running.wait_ready()
        yield running


@pytest.fixture
def client(stack):
    stack.check_alive()
    rollout = RolloutClient(stack.redis_url)
    yield rollout
    rollout.close()


@pytest.fixture(scope="session")
def k8s_cluster():
    try:
        cluster = kc.ensure_cluster()
    except (kc.ClusterUnavailable, OSError) as exc:
        pytest.fail(f"no Kubernetes cluster for the k8s tests: {exc}", pytrace=False)
    yield cluster
    kc.stop_cluster(cluster)


@pytest.fixture
def k8s_namespace(k8s_cluster, request):
    name = kc.create_test_namespace(k8s_cluster, request.node.name)
    yield name
    kc.delete_namespace(k8s_cluster, name)


@pytest.fixture(scope="session")
def kwok_nodes(k8s_cluster):
    if not k8s_cluster.has_kwok():
        if k8s_cluster.local:
            pytest.fail("the local cluster serves no kwok.x-k8s.io API: KWOK controller broken")
        pytest.skip(f"cluster at {k8s_cluster.kubeconfig} runs no KWOK controller")
    count = int(os.environ.get("ROLLOUT_KWOK_NODES", "4"))
    return kc.ensure_kwok_nodes(k8s_cluster, count)


@pytest.fixture
def kwok_logs(k8s_cluster, k8s_namespace, tmp_path):
    """``kwok_logs(pod_name, lines, namespace=None, containers=None) -> Path``.

    Writes ``lines`` to a CRI-format file and creates a KWOK ``Logs`` object so that the Pod's
    log, read through the API server, is those lines (KWOK picks the object up within moments,
    so poll the first read).
    """

    def make(pod_name: str, lines, namespace: str | None = None, containers=None):
        path = kc.write_cri_log(tmp_path / f"{pod_name}.log", lines)
        kc.create_pod_logs(
            k8s_cluster, namespace or k8s_namespace, pod_name, path, containers=containers
        )
        return path

    return make
