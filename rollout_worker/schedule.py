"""Can a batch finish within its deadline at all? The arithmetic, refused up front.

Two floors bound how fast a batch can run, whatever the workers do:

- Pod creation (Kubernetes): the Job controller creates the batch's Pods through its client,
  which kube-controller-manager rate-limits (`--kube-api-qps`, default 20 requests/s; each Pod
  costs a create and, once it ends, a patch that removes the Job's tracking finalizer, so a
  stock controller manager creates about 10 Pods/s: measured 10.2/s on the local cluster with
  --kube-api-qps 20, benchmarks/bench_job_create.py). ROLLOUT_POD_CREATE_RATE is that rate.
  The last Pod exists no earlier than count / rate seconds after the Job, and then still has
  to run.
- Waves: at most `parallelism` episodes run at once, so ceil(count / parallelism) episodes run
  one after another in some slot, each taking at least the expected episode time (when the
  caller knows it) or the backend's floor (the shortest episode ever measured on it).

The minimum is the larger of the two. A batch whose minimum exceeds its deadline cannot
succeed; `deadline_problem` says so with the numbers, and what would make it fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The shortest an episode takes, per backend, when the request says nothing better. Lower
# bounds on purpose (a refusal must never hit a batch that could have finished): a Kubernetes
# Pod is scheduled, started, runs and is reported terminal in no less than about a second
# (KWOK's own stages take 1-2.5 s; the real node about 5 s for the demo episode); a local
# sandbox runs the demo episode in 0.3-0.7 s on this 2-core machine, and so does one in a
# sandbox host (`isolation: host`: the same bubblewrap sandbox, in a long-lived Pod).
EPISODE_FLOOR_SECONDS = {"kubernetes": 1.0, "local": 0.2, "hosts": 0.2}


@dataclass(frozen=True)
class Schedule:
    """The least time a batch needs, and where it comes from."""

    count: int
    parallelism: int
    episode_seconds: float
    create_rate: float | None  # Pods per second; None: nothing is rate-limited (local)
    creation_seconds: float  # count / rate + one episode (0 when not rate-limited)
    waves: int
    waves_seconds: float  # waves x episode_seconds

    @property
    def minimum_seconds(self) -> float:
        return max(self.creation_seconds, self.waves_seconds)


def minimum_time(
    count: int,
    parallelism: int,
    *,
    episode_seconds: float,
    create_rate: float | None,
) -> Schedule:
    """The least time `count` episodes need at `parallelism` (see the module's docstring)."""
    if count < 1 or parallelism < 1:
        raise ValueError("count and parallelism must be at least 1")
    if episode_seconds < 0:
        raise ValueError("episode_seconds must not be negative")
    if create_rate is not None and create_rate <= 0:
        raise ValueError("create_rate must be positive (None: not rate-limited)")
    waves = math.ceil(count / min(parallelism, count))
    creation = count / create_rate + episode_seconds if create_rate else 0.0
    return Schedule(
        count=count,
        parallelism=parallelism,
        episode_seconds=episode_seconds,
        create_rate=create_rate,
        creation_seconds=creation,
        waves=waves,
        waves_seconds=waves * episode_seconds,
    )


def episode_floor(backend: str, expected_seconds: float | None = None) -> float:
    """The episode time to plan with: the caller's expectation when given, else the floor."""
    if expected_seconds is not None and expected_seconds > 0:
        return float(expected_seconds)
    return EPISODE_FLOOR_SECONDS.get(backend, 0.0)


def deadline_problem(
    count: int,
    parallelism: int,
    deadline_seconds: float,
    *,
    backend: str,
    create_rate: float | None,
    expected_episode_seconds: float | None = None,
) -> str | None:
    """A refusal with the arithmetic when the batch cannot finish in its deadline, else None.

    `create_rate` is ROLLOUT_POD_CREATE_RATE; it applies to the kubernetes backend only (0 or
    None: do not count Pod creation).
    """
    rate = create_rate if backend == "kubernetes" and create_rate else None
    floor = episode_floor(backend, expected_episode_seconds)
    plan = minimum_time(count, parallelism, episode_seconds=floor, create_rate=rate)
    if plan.minimum_seconds <= deadline_seconds + 1e-9:  # (float products such as 1200 x 0.2)
        return None
    what = (
        f"an expected {floor:g} s per episode"
        if expected_episode_seconds
        else f"at least {floor:g} s per episode on {backend}"
    )
    parts = []
    if rate is not None:
        parts.append(
            f"creating {count} Pods at {rate:g}/s (ROLLOUT_POD_CREATE_RATE) takes "
            f"{count / rate:.0f} s, plus {floor:g} s for the last episode = "
            f"{plan.creation_seconds:.0f} s"
        )
    parts.append(
        f"{plan.waves} wave(s) of at most {min(parallelism, count)} episodes x {floor:g} s = "
        f"{plan.waves_seconds:.0f} s"
    )
    fixes = [f"a deadline_seconds of at least {math.ceil(plan.minimum_seconds)}"]
    if rate is not None and plan.creation_seconds > deadline_seconds:
        fits = math.floor((deadline_seconds - floor) * rate)
        if fits >= 1:
            fixes.append(f"batches of at most {fits} episodes")
        fixes.append("a higher ROLLOUT_POD_CREATE_RATE if the cluster creates Pods faster")
    max_waves = math.floor(deadline_seconds / floor) if floor else 0
    if plan.waves_seconds > deadline_seconds and max_waves >= 1:
        fixes.append(f"parallelism of at least {math.ceil(count / max_waves)}")
    return (
        f"{count} episodes cannot finish within deadline_seconds {deadline_seconds:g} "
        f"({what}): {'; '.join(parts)}; the batch needs at least "
        f"{plan.minimum_seconds:.0f} s. Ask for " + ", or ".join(fixes)
    )
