"""The policy endpoint: parsed once by parse_spec into a typed value, the same object on the
wire."""

from __future__ import annotations

import json

import orjson
import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.policy import PolicyEndpoint
from rollout_wire.request import BatchSpec, parse_spec

TASKS = [{"id": "t1", "statement": "fix it", "files": {"a.py": "x = 1\n"}, "test_command": ["f"]}]
# What a stored receipt has held for a policy since before the typed value: all five keys.
WIRE = {
    "url": "http://10.0.0.5:8000",
    "model": "m",
    "sampling": {"temperature": 0.7},
    "request_timeout_seconds": 30,
    "max_retries": 1,
    "max_policy_lag": None,
    "trainer": "default",
    "tokens": True,
}


def policy_of(policy, **request):
    spec = parse_spec({"tasks": TASKS, "policy": policy, **request}, max_episodes=100)
    assert spec.policy is not None
    return spec.policy


def test_an_ipv4_endpoint_is_one_address_for_the_network_policy():
    p = policy_of({"url": "http://10.0.0.5:8000"}, backend="kubernetes")
    assert (p.scheme, p.host, p.port, p.path) == ("http", "10.0.0.5", 8000, "")
    assert p.is_ip and p.ip_version == 4
    assert p.cidr == "10.0.0.5/32" and p.endpoint == ("10.0.0.5", 8000)


def test_an_ipv6_endpoint_is_a_slash_128():
    p = PolicyEndpoint("http://[fd00::7]:9000")
    assert (p.host, p.port, p.ip_version, p.cidr) == ("fd00::7", 9000, 6, "fd00::7/128")


@pytest.mark.parametrize(
    ("url", "port"),
    [("http://10.0.0.5", 80), ("https://10.0.0.5", 443), ("https://10.0.0.5:8443", 8443)],
)
def test_a_url_without_a_port_uses_its_schemes_default(url, port):
    assert policy_of({"url": url}).port == port


def test_a_name_is_no_address_and_kubernetes_refuses_it():
    p = policy_of({"url": "http://policy.example:8000/base/"})
    assert (p.url, p.host, p.path, p.is_ip, p.ip_version) == (
        "http://policy.example:8000/base",
        "policy.example",
        "/base",
        False,
        None,
    )
    with pytest.raises(ValueError, match="not an IP address"):
        _ = p.cidr
    with pytest.raises(InvalidSpec) as info:
        policy_of({"url": "http://policy.example:8000"}, backend="kubernetes")
    assert info.value.problems == [
        "policy.url host 'policy.example' must be an IP address on kubernetes: the batch's "
        "NetworkPolicy allows egress to that address only (it cannot match names)"
    ]


@pytest.mark.parametrize("url", ["http://10.0.0.5:99999", "http://10.0.0.5:0"])
def test_a_port_out_of_range_is_a_bad_url(url):
    with pytest.raises(InvalidSpec) as info:
        policy_of({"url": url})
    assert [p for p in info.value.problems if p.startswith(f"policy.url {url!r} must be")]
    assert not [p for p in info.value.problems if "tasks need a policy" in p]


def test_the_runner_gets_the_policy_without_its_url():
    p = policy_of({"url": "http://10.0.0.5:8000", "sampling": {"top_p": 0.9}})
    config = {
        "model": "policy",
        "sampling": {"top_p": 0.9},
        "request_timeout_seconds": 60,
        "max_retries": 2,
    }
    assert p.runner_config() == config
    assert json.loads(p.runner_json()) == config
    assert list(json.loads(p.runner_json())) == list(config)  # the order it always had


def test_the_wire_form_is_the_request_object_it_always_was():
    p = policy_of(WIRE)
    assert p.to_dict() == WIRE and list(p.to_dict()) == list(WIRE)
    assert PolicyEndpoint.from_dict(WIRE) == p
    assert PolicyEndpoint.from_dict(WIRE).cidr == "10.0.0.5/32"  # derived again when decoded
    # The spec's JSON (the receipt) keeps the policy as that object, and decodes to the same.
    spec = parse_spec({"tasks": TASKS, "policy": WIRE}, max_episodes=100)
    stored = orjson.loads(orjson.dumps(spec.to_dict()))
    assert stored["policy"] == WIRE
    assert BatchSpec.from_dict(stored) == spec
    assert BatchSpec.from_dict(stored).policy == p
    # A demo batch has none, before and after.
    demo = parse_spec({"count": 2}, max_episodes=10)
    assert demo.to_dict()["policy"] is None and BatchSpec.from_dict(demo.to_dict()) == demo


def test_token_ids_are_asked_for_unless_the_batch_says_not_to():
    assert policy_of(WIRE).tokens is True and "tokens" not in policy_of(WIRE).runner_config()
    quiet = policy_of(WIRE | {"tokens": False})
    assert quiet.runner_config()["tokens"] is False
    assert list(quiet.to_dict()) == list(WIRE) and quiet.to_dict()["tokens"] is False
    with pytest.raises(InvalidSpec, match=r"policy\.tokens must be true"):
        policy_of(WIRE | {"tokens": "yes"})


def test_a_parsed_spec_can_be_submitted_again():
    """The trainer parses, sends `to_dict()`, the worker parses again: same policy."""
    spec = parse_spec({"tasks": TASKS, "policy": {"url": "http://10.0.0.5:8000/"}}, max_episodes=9)
    again = parse_spec(spec.to_dict(), max_episodes=9)
    assert again.policy == spec.policy and again.policy is not None
    assert again.policy.url == "http://10.0.0.5:8000"
    # The typed value itself is accepted where a request object is.
    assert parse_spec({"tasks": TASKS, "policy": spec.policy}, max_episodes=9).policy == spec.policy
