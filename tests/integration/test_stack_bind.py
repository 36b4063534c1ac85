"""LocalStack's `redis_bind`: the stack's redis-server also listens on a non-loopback address
(the real node's, for host Pods), and only when asked (tests/k8s/test_hosts.py relies on it)."""

from __future__ import annotations

import socket

import pytest
import redis

from rollout_worker.cli.stack import LocalStack

pytestmark = pytest.mark.redis


def machine_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("198.51.100.1", 9))  # TEST-NET-2: never sent
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), address
    return address


def answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


@pytest.mark.parametrize("password", [None, "s3cret"])
def test_redis_listens_on_the_bind_address_only_when_asked(password):
    address = machine_address()
    plain = LocalStack(password=password)
    plain.start_redis()
    try:
        assert answers(plain.redis_url)
        assert not answers(plain.redis_url_at(address))  # loopback only by default
    finally:
        plain.stop()
    bound = LocalStack(password=password, redis_bind=address)
    bound.start_redis()
    try:
        assert bound.redis_url.startswith(("redis://127.0.0.1:", "redis://:s3cret@127.0.0.1:"))
        assert answers(bound.redis_url) and answers(bound.redis_url_at(address))
    finally:
        bound.stop()
