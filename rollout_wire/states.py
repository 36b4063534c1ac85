"""Every state the wire carries, as one enum each (string-valued: the JSON value is the member's
value, so rows, reports and receipts written before these enums read the same).

Workers and clients compare against these members, never against string literals.
"""

from __future__ import annotations

from enum import StrEnum


class EpisodeStatus(StrEnum):
    """A row's status. `ok` passed every rule of the guide; `failed` ended but broke a rule
    (its reward is 0); `lost` never gave a usable outcome before the deadline. `aborted` (the
    batch had its quota of groups, so the rest was stopped) and `stale` (its first turn was
    more than `max_policy_lag` versions behind the trainer) are neither a failure nor a
    reward: they enter no group's figures."""

    OK = "ok"
    FAILED = "failed"
    LOST = "lost"
    ABORTED = "aborted"
    STALE = "stale"

    @property
    def withdrawn(self) -> bool:
        """Stopped on purpose by the service (aborted, stale): no sample, no failure."""
        return self in (EpisodeStatus.ABORTED, EpisodeStatus.STALE)


class FailureKind(StrEnum):
    """Why a row that is not ok is not. `infrastructure` (the sandbox never started, the policy
    endpoint was unreachable or timed out, a deadline, a lost supervisor): the row is NOT a
    sample of the policy and must not enter a reward average. `episode`: the episode itself
    broke a rule (its record is invalid)."""

    INFRASTRUCTURE = "infrastructure"
    EPISODE = "episode"


class Progress(StrEnum):
    """Where a running episode is, as streamed before its row (the row ends it)."""

    PENDING = "pending"
    RUNNING = "running"
    READY = "ready"
    REWARDED = "rewarded"


class EventKind(StrEnum):
    """An episode log line's `event`: what the runner (rollout_worker/sandbox, which cannot
    import this; a unit test holds its names to these) printed. `ready` starts a sandbox's
    part, one `step` per policy turn or recorded exchange, `agent_exit` after an agent command;
    a final event ends the sandbox's part (`FINAL_EVENTS`)."""

    READY = "ready"
    STEP = "step"
    AGENT_EXIT = "agent_exit"
    REWARD = "reward"
    # The agent's sandbox of a `grade: fresh` episode is done: its grader's log follows.
    GRADE_PENDING = "grade_pending"
    # In place of the reward: the runner's policy moved past the episode's max_policy_lag.
    STALE = "stale"
    ERROR = "error"


# How a runner's log line names its event (json.dumps' default separators): readers that only
# look for an event search the raw bytes for these instead of parsing every line.
EVENT_KEY_MARK = '"event"'


def event_mark(kind: EventKind) -> str:
    """The text of a log line that carries event `kind`."""
    return f'{EVENT_KEY_MARK}: "{kind.value}"'


# The events that end one sandbox's part of an episode; the runner's cost ledger rides on them.
FINAL_EVENTS = (EventKind.REWARD, EventKind.GRADE_PENDING, EventKind.STALE, EventKind.ERROR)
# The events that say how an episode ended (a trajectory's `outcome`).
OUTCOME_EVENTS = (EventKind.REWARD, EventKind.ERROR, EventKind.STALE)


class BatchStatus(StrEnum):
    """A report's `status`: how the batch ended (`rejected`: the request was refused before
    anything was created; `error`: the backend could not start the run)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    HALTED = "halted"  # the circuit breaker stopped it (max_consecutive_infra_failures)
    QUOTA_NOT_MET = "quota-not-met"  # every group ended, fewer than groups_wanted passed
    REJECTED = "rejected"
    ERROR = "error"


class RunVerdict(StrEnum):
    """How a run ended, as its backend reads it (a report's and a receipt's `run_verdict`): the
    Kubernetes Job controller's words, which the local backend takes on. `running`: not settled
    yet; `suspended`: a cancelled Job stopped its Pods; `unknown`: never read."""

    COMPLETE = "Complete"
    FAILED = "Failed"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    UNKNOWN = "Unknown"


class SubmitStatus(StrEnum):
    """What `submit_batch` answered (its Celery result; the report says how the batch ended)."""

    STARTED = "started"
    REJECTED = "rejected"
    CONFLICT = "conflict"  # the batch id is taken by a different request
    DONE = "done"  # a redelivered submit of a batch already reported
    ERROR = "error"


class Cleanup(StrEnum):
    """The run's deletion, in the receipt's `cleanup` field and the report's."""

    KEPT = "kept"
    SCHEDULED = "scheduled"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"


class Records(StrEnum):
    """The run's records (job.json, pods.json, events...), saved after the report."""

    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"


class FinalizedBy(StrEnum):
    """Who published the report: the chord's callback, or the watchdog when the chord stalled."""

    CHORD = "chord"
    WATCHDOG = "watchdog"


class GroupStatus(StrEnum):
    """A task group's status in the report: `complete` (every sample valid), `failed` (some
    sample failed for infrastructure: the group is not a fair sample), `incomplete` (some
    sample broke an episode rule)."""

    COMPLETE = "complete"
    FAILED = "failed"
    INCOMPLETE = "incomplete"
    ABORTED = "aborted"  # some sample was aborted (the quota was met) or stale


class GroupFilter(StrEnum):
    """Which complete groups count towards a batch's `groups_wanted`: `any`, or `varied` (at
    least two distinct rewards: DAPO's rule, a group whose rewards are all equal gives no
    group-relative signal)."""

    ANY = "any"
    VARIED = "varied"


class GradedBy(StrEnum):
    """How a row's reward was graded. `test_results`: the counts the grader's test harness
    reported on a channel the code under test cannot print to (unittest, pytest); `exit_status`:
    a test command the harness cannot count (a task's own script), by its exit status alone;
    `reward_file`: what the tests wrote to the verifier's reward file."""

    TEST_RESULTS = "test_results"
    EXIT_STATUS = "exit_status"
    REWARD_FILE = "reward_file"


class GradeCause(StrEnum):
    """Why a row's reward is below full (None when the tests earned it all)."""

    TESTS_FAILED = "tests_failed"
    TESTS_MISSING = "tests_missing"  # fewer ran than the task promised (its baseline), or none
    RUNNER_EXITED = "runner_exited"  # the test run ended before it reported its end
    TESTS_TIMED_OUT = "tests_timed_out"
    TESTS_TAMPERED = "tests_tampered"  # the code under test replaced unittest's machinery
    EXIT_STATUS = "exit_status"  # every test passed, yet the command exited non-zero
    NO_REWARD_FILE = "no_reward_file"
    REWARD_FILE_INVALID = "reward_file_invalid"  # too large, not a bounded number, a link
    REWARD_FILE = "reward_file"  # the tests wrote a reward below 1
    # The backend answered more policy completions than the runner sent and recorded: the
    # agent reached the policy around the recording (its trajectory is not what was sampled).
    UNRECORDED_COMPLETIONS = "unrecorded_completions"
