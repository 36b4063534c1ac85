"""Fixtures for tests that need Pods to really run (marker ``k8s_real``).

Registered from tests/conftest.py (``from tests.k8s.node_fixtures import real_node``), next to
the other k8s fixtures:

- ``real_node`` (session): a :class:`tests.k8s.cluster.RealNode` that is Ready. On the local
  cluster it runs ``hack/localkube/cluster.sh node-up`` (kubelet + private containerd, images
  built locally); ``cluster.sh down`` at the end of the session stops it with the cluster. If
  the node cannot start the tests fail, never skip. On another cluster (``KUBECONFIG``) a Ready
  node labelled ``rollout.dev/node=real`` must exist, or the tests fail; leave them out on
  purpose with ``-m "not k8s_real"`` or ``ROLLOUT_TEST_SKIP=k8s_real`` (see tests/conftest.py).
"""

from __future__ import annotations

import pytest

from tests.k8s import cluster as kc


@pytest.fixture(scope="session")
def real_node(k8s_cluster) -> kc.RealNode:
    from tests.conftest import fail_missing  # loaded by now; imports this module at its top

    try:
        return kc.ensure_real_node(k8s_cluster)
    except kc.RealNodeUnavailable as exc:
        if k8s_cluster.local:
            fail_missing("k8s_real", f"the local cluster's real node did not start: {exc}")
        fail_missing("k8s_real", str(exc))
    except OSError as exc:
        fail_missing("k8s_real", f"could not run cluster.sh node-up: {exc}")
