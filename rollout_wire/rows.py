"""What comes back to the trainer: one row per episode, and the report's headline fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rollout_wire.states import EpisodeStatus, FailureKind, GroupFilter, GroupStatus

# The headline numbers of a report, in the order people read them (CLI tables, summaries).
REPORT_METRICS = (
    "episodes",
    "successful_episodes",
    "failed_episodes",
    "lost_episodes",
    "reward_sum",
    "parallelism",
    "warm_episodes",
    "slot_utilisation",
    "batch_to_all_ready_seconds",
    "pod_to_ready_p50_seconds",
    "pod_to_ready_p95_seconds",
    "pod_to_ready_max_seconds",
    "batch_to_all_rewards_seconds",
    "job_complete_seconds",
)

# An episode's cost ledger (EpisodeRow.cost), as the runner measures it at the end of each of
# its sandboxes (rollout_worker/sandbox/runner/cost.py) and validation checks it. Seconds and bytes
# are numbers >= 0, counts integers >= 0; any of them None when unknown.
COST_SECONDS = (
    "cpu_seconds",  # user + system, every process of the sandbox
    "cpu_user_seconds",
    "cpu_system_seconds",
    "policy_seconds",  # wall time spent waiting on the policy
    "policy_retry_seconds",  # of those, failed attempts': not counted against the time limit
    "ledger_cpu_seconds",  # what reading the ledger itself cost the runner
)
# policy_requests: every request the runner sent to the policy (each attempt).
COST_COUNTS = ("policy_turns", "prompt_tokens", "completion_tokens", "policy_requests")
# The largest: on Kubernetes the container's cgroup peak; locally the largest single process.
COST_PEAK = "peak_memory_bytes"
# A `file` reward beyond this magnitude is refused (the runner's MAX_REWARD_MAGNITUDE): a file
# the code under test can write must not hand the trainer 1e308.
MAX_FILE_REWARD = 1000.0
# The runner's bounds on artifacts_refused (runner/artifacts.py MAX_ARTIFACT_REFUSALS; a path
# is cut to 200 characters, its reason is the runner's own short text).
MAX_ARTIFACT_REFUSALS = 50
MAX_ARTIFACT_REFUSAL_CHARS = 1000
COST_SOURCES = ("cgroup", "proc")  # `cpu_source`: where the CPU and memory figures come from
# `wall`: sandbox seconds per phase, from the row's own timestamps and the runner's events:
# start (created or claimed -> ready), agent (the agent's turns, or its command),
# grader_start (a second, grading sandbox's start) and tests (the grading).
COST_PHASES = ("start", "agent", "grader_start", "tests")


@dataclass
class EpisodeRow:
    """One episode's validated outcome, as the trainer and results.json see it.

    `pod` is the episode id: the Pod name on Kubernetes, the sandbox name locally.
    """

    index: int
    pod: str
    status: EpisodeStatus
    errors: list[str] = field(default_factory=list)
    reward: float = 0
    baseline_exit: int | None = None
    tests_exit: int | None = None
    exit_code: int | None = None
    restart_count: int = 0
    phase: str | None = None
    node: str | None = None
    image_id: str | None = None
    created_at: float | None = None
    ready_at: float | None = None
    reward_at: float | None = None
    finished_at: float | None = None
    pod_to_ready_seconds: float | None = None
    batch_to_ready_seconds: float | None = None
    batch_to_reward_seconds: float | None = None
    timing: dict[str, float | None] = field(default_factory=dict)
    collected_at: float | None = None
    # Real rollouts: the task and sample this episode ran, its group (the samples of one task
    # in one batch), and how the agent loop ended.
    task_id: str | None = None
    sample: int | None = None
    group_id: str | None = None
    steps: int | None = None
    stop_reason: str | None = None  # submit | max_steps | time_limit | response_too_large | stale
    tests_passed: int | None = None
    tests_total: int | None = None
    # How the reward was graded (GradedBy: the harness's counts, the test command's exit
    # status, or the tests' reward file), why it is below full (GradeCause; None when the
    # tests earned it all), and how many tests the task promised (the baseline's count).
    graded_by: str | None = None
    grade_cause: str | None = None
    tests_promised: int | None = None
    failure_kind: FailureKind | None = None  # when the row is not ok
    failure_cause: str | None = None  # the first reason, short
    # Earlier attempts run again under the batch's retry budget (infra_retries), oldest first:
    # each {episode_id, exit_code, reason, cause, finished_at}. `pod` is the last attempt.
    retried: list[dict[str, Any]] = field(default_factory=list)
    # The policy versions its turns were answered by (X-Policy-Version, or the server's
    # `weight_version`): {"first": ..., "last": ...}; None when the server names none.
    policy_versions: dict[str, Any] | None = None
    # An agent run as a command (`agent`): its exit code (None: killed at its time limit, see
    # stop_reason), the last lines it printed, and its seconds.
    agent_exit_code: int | None = None
    agent_output: str | None = None
    agent_seconds: float | None = None
    # A `file` reward's other numbers (Harbor's reward.json may hold several).
    reward_details: dict[str, float] | None = None
    # A task with steps (Harbor's [[steps]]): each step that ran, in order, {name, reward,
    # grade_cause, tests_exit}; `reward` is their combination (the task's
    # step_reward_strategy). None for a task without steps.
    step_rewards: list[dict[str, Any]] | None = None
    # The task's artifacts the runner would not read, each "path: why" (a link, a FIFO, over
    # its bounds); None when the task lists no artifacts. The files read are in the log.
    artifacts_refused: list[str] | None = None
    # What the episode used (COST_SECONDS, COST_COUNTS, COST_PEAK, cpu_source, wall); None when
    # its runner measured nothing (an older runner, or one that never reached its outcome).
    cost: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Typed however it was built (a plain "ok" from a caller reads as the member).
        self.status = EpisodeStatus(self.status)

    @property
    def ok(self) -> bool:
        return self.status == EpisodeStatus.OK

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeRow:
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["status"] = EpisodeStatus(values["status"])
        if values.get("failure_kind") is not None:
            values["failure_kind"] = FailureKind(values["failure_kind"])
        return cls(**values)


def group_passes(group: Mapping[str, Any], group_filter: str) -> bool:
    """Whether a group (a `group` stream entry, a report's group) counts: complete (every
    sample valid), and with `varied` at least two distinct rewards."""
    if group.get("status") != GroupStatus.COMPLETE:
        return False
    return group_filter != GroupFilter.VARIED or bool(group.get("varied"))
