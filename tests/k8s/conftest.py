"""The k8s fixtures live in tests/conftest.py so every test directory can use them; only the
sandbox-host image (tests/k8s/host_pool.py), which the host tests here alone need, is
registered here."""

from tests.k8s.host_pool import host_image  # noqa: F401 - a fixture
