"""A lease renewed while its holder works (`core.lease.renewed`)."""

from __future__ import annotations

import threading

import pytest

from rollout_worker.core.lease import renewed

WAIT_S = 5.0  # far beyond what any assertion below needs: only a hang fails on it


def test_it_is_renewed_while_the_block_runs_and_no_more_after():
    calls: list[int] = []
    thrice = threading.Event()

    def renew() -> bool:
        calls.append(1)
        if len(calls) == 3:
            thrice.set()
        return True

    with renewed(renew, every=0.005, at_most=60):
        assert thrice.wait(WAIT_S)
    after = len(calls)
    threading.Event().wait(0.05)
    assert len(calls) == after


@pytest.mark.parametrize("answer", [False, ConnectionError("redis went away")])
def test_a_lost_or_unreachable_lease_is_not_renewed_again(answer):
    calls: list[int] = []
    ended = threading.Event()

    def renew() -> bool:
        calls.append(1)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with renewed(renew, every=0.005, at_most=60):
        for _ in range(int(WAIT_S / 0.005)):
            if calls:
                break
            ended.wait(0.005)
        ended.wait(0.1)
    assert calls == [1]


def test_a_holder_stuck_for_good_stops_renewing_after_at_most():
    calls: list[int] = []
    with renewed(lambda: calls.append(1) is None, every=0.005, at_most=0.03):
        threading.Event().wait(0.3)
    assert len(calls) <= 6  # about 60 without the bound
