"""The project's error hierarchy. Third-party errors are translated into these at the edges."""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of every error this project raises on purpose."""


class InvalidSpec(RolloutError):
    """A batch request is malformed or outside what is allowed; nothing was started."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid batch request: " + "; ".join(self.problems))


class ConfigError(RolloutError):
    """A setting (environment variable or option) has a value we cannot use."""


class OutputDirError(RolloutError):
    """The records directory cannot be used (exists already, or is not writable)."""


class BackendError(RolloutError):
    """A backend failed to start, observe, read or delete a run."""


class BackendUnavailable(BackendError):
    """The requested backend cannot run on this machine or configuration."""


class TransientBackendError(BackendError):
    """A backend call failed in a way that a retry may fix (timeouts, 5xx, conflicts)."""


class ResourceNotFound(BackendError):
    """The API server says the object does not exist (404)."""


class ResourceConflict(BackendError):
    """The object already exists or changed under us (409)."""


class CapacityError(BackendError):
    """The cluster cannot hold the requested parallelism; the message shows the arithmetic."""


class OwnershipError(BackendError):
    """A resource exists but cannot be proven to be ours, so we refuse to touch it."""


class BatchTimeout(RolloutError):
    """Waiting for a batch report ran past the caller's timeout."""


class SamplingStopped(RolloutError):
    """Continuous sampling cannot go on: a batch it submitted ended without running (rejected,
    or the backend refused it), so every batch after it would too. The message says why."""


class RedisUnavailable(RolloutError):
    """Redis stayed unreachable for longer than the client is willing to wait (its outage
    limit: every client call, a send included, waits out a restart), or refused the client
    (a wrong password). The message is one line naming the URL, its password masked."""


class StackError(RolloutError):
    """The all-in-one stack (private redis-server and workers) failed to start or died."""


class TaskWarning(UserWarning):
    """A task.toml key let through but not honoured as Harbor would (an unknown key under
    allow_unknown_keys, a limit not enforced): loading tasks warns, never silently."""
