"""Fixtures for tests that need Pods to really run (marker ``k8s_real``).

Registered from tests/conftest.py (``from tests.k8s.node_fixtures import real_node``), next to
the other k8s fixtures:

- ``real_node`` (session): a :class:`tests.k8s.cluster.RealNode` that is Ready. On the local
  cluster it runs ``hack/localkube/cluster.sh node-up`` (kubelet + private containerd, images
  built locally); ``cluster.sh down`` at the end of the session stops it with the cluster. If
  the node cannot start the tests fail, never skip. On another cluster (``KUBECONFIG``), tests
  are skipped unless a Ready node is labelled ``rollout.dev/node=real``.
"""

from __future__ import annotations

import pytest

from tests.k8s import cluster as kc


@pytest.fixture(scope="session")
def real_node(k8s_cluster) -> kc.RealNode:
    try:
        return kc.ensure_real_node(k8s_cluster)
    except kc.RealNodeUnavailable as exc:
        if k8s_cluster.local:
            pytest.fail(f"the local cluster's real node did not start: {exc}", pytrace=False)
        pytest.skip(str(exc))
    except OSError as exc:
        pytest.fail(f"could not run cluster.sh node-up: {exc}", pytrace=False)
