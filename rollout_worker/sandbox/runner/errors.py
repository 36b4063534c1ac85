"""How an episode ends other than with a reward: the failures and their exit codes."""

from __future__ import annotations

EXIT_EPISODE_ERROR = 3
EXIT_INFRASTRUCTURE = 4


class InfrastructureError(Exception):
    """The policy could not be used: not the episode's fault, never a reward."""


class ConnectTimeout(OSError):
    """The policy endpoint accepted no connection within CONNECT_TIMEOUT_SECONDS."""


class EpisodeError(Exception):
    """The task (or its agent) is broken: no sample of the policy, not worth a retry."""


class ResponseTooLarge(Exception):
    """The policy generated more than a turn may hold, under the batch's own settings: the
    episode's doing (its loop ends and the tests grade it), never an infrastructure failure."""


class StalePolicy(Exception):
    """The policy moved on past the episode's staleness bound: the episode stops, unscored."""

    def __init__(self, first: str, version: str, lag: int, max_lag: int, steps: int) -> None:
        super().__init__(f"policy at version {version}, first turn at {first}")
        self.fields = {
            "first_version": first,
            "version": version,
            "lag": lag,
            "max_policy_lag": max_lag,
            "steps": steps,
        }
