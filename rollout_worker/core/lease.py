"""A lease kept alive while its holder works: a thread renews it until the block ends.

A lease that lasts as long as the slowest holder could take keeps a dead holder's successors
waiting that long too (a submit killed mid-send held its batch for 80 s). A short lease renewed
by a live holder lapses soon after the holder dies, and still covers a slow one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def renewed(renew: Callable[[], bool], *, every: float, at_most: float) -> Iterator[None]:
    """Call `renew` every `every` seconds while the block runs, for at most `at_most` seconds
    (a holder stuck for good must not hold its lease for good). Stops early if `renew` says the
    lease was lost or raises (Redis away: the lease lapses, as for a dead holder)."""
    done = threading.Event()
    give_up = time.monotonic() + at_most

    def keep() -> None:
        while not done.wait(every) and time.monotonic() < give_up:
            try:
                if not renew():
                    log.warning("lease lost while its holder still works")
                    return
            except Exception as exc:
                log.warning("lease not renewed: %s", exc)
                return

    thread = threading.Thread(target=keep, name="lease-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
