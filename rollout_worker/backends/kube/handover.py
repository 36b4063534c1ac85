"""Direct hand-over to a waiting pool Pod: the worker connects to the Pod's IP on
objects.HANDOVER_PORT and sends `token\\n` + the hand-over line; the runner (sandbox/runner/
task.py wait_for_handover) answers `ok\\n` and closes its listener before the episode runs.

Why: an attach through the API server costs the node about 40 ms of CPU (kube-apiserver,
kubelet, containerd), a TCP connection next to nothing, so a burst of hand-overs no longer
queues on the node's cores. The attach stays the fallback (pools.py `_hand_over`).

On only with ROLLOUT_WARM_HANDOVER_FROM (the CIDR the pool's `warm-handover` NetworkPolicy
opens the port to), and only for a Pod whose spec carries the port and its own token (a Pod
filled by an attach-only worker has neither and is handed over by attach).
"""

from __future__ import annotations

import enum
import socket
import time
from dataclasses import dataclass
from typing import Any

from rollout_worker.backends.kube import objects

# A Pod on the node's network answers a connect within milliseconds; past this it is not
# reachable directly (no route, a policy dropping the SYN) and the attach takes over.
CONNECT_SECONDS = 1.0
REFUSED_PAUSE_SECONDS = 0.02
ACK = b"ok\n"


class Sent(enum.Enum):
    ACKED = "acked"  # the runner has its episode
    UNREACHED = "unreached"  # nothing was sent: the attach may hand it over
    UNCONFIRMED = "unconfirmed"  # sent, no ack: the runner may or may not have it


@dataclass(frozen=True)
class Direct:
    """Where and how a waiting Pod takes its line directly."""

    ip: str
    port: int
    token: str = ""

    def __repr__(self) -> str:  # never the token in a log
        return f"Direct({self.ip}:{self.port})"


def direct_target(pod: dict[str, Any]) -> Direct | None:
    """The Pod's IP, port and token, or None when it was not made for a direct hand-over (no
    token in its spec) or has no IP yet."""
    ip = (pod.get("status") or {}).get("podIP")
    containers = (pod.get("spec") or {}).get("containers") or []
    if not ip or not containers:
        return None
    env = {e.get("name"): e.get("value") for e in containers[0].get("env") or []}
    token, port = env.get(objects.HANDOVER_TOKEN_ENV), env.get(objects.HANDOVER_PORT_ENV)
    if not token or not port or not str(port).isdigit():
        return None
    return Direct(str(ip), int(port), str(token))


def send(target: Direct, line: bytes, confirm_seconds: float) -> Sent:
    """Connect, send the token and the line, wait up to `confirm_seconds` for the ack."""
    conn = _connect(target)
    if conn is None:
        return Sent.UNREACHED
    with conn:
        try:
            conn.sendall(target.token.encode() + b"\n" + line)
        except OSError:
            # Part of it may have gone: the runner may have read it all before the error.
            return Sent.UNCONFIRMED
        return Sent.ACKED if _ack(conn, confirm_seconds) else Sent.UNCONFIRMED


def _connect(target: Direct) -> socket.socket | None:
    """A connection within CONNECT_SECONDS. Refused is tried again until then: a Pod counts as
    waiting once its container runs, a moment before its runner listens (stdin buffers an
    attach's line meanwhile; a port does not)."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return socket.create_connection((target.ip, target.port), timeout=left)
        except ConnectionRefusedError:
            time.sleep(min(REFUSED_PAUSE_SECONDS, max(0.0, deadline - time.monotonic())))
        except OSError:
            return None


def _ack(conn: socket.socket, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    got = b""
    while len(got) < len(ACK):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        conn.settimeout(left)
        try:
            chunk = conn.recv(len(ACK) - len(got))
        except OSError:
            return False
        if not chunk:
            return False
        got += chunk
    return got == ACK
