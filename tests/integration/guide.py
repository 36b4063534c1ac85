"""What the guide's results.json holds: every run of ours must hold at least that."""

GUIDE_FIELDS = (
    "episodes",
    "successful_episodes",
    "reward_sum",
    "batch_to_all_ready_seconds",
    "pod_to_ready_p50_seconds",
    "pod_to_ready_p95_seconds",
    "pod_to_ready_max_seconds",
    "batch_to_all_rewards_seconds",
    "client_submit_to_report_seconds",
    "parallelism",
    "image",
    "runtime",
    "pods",
    "nodes",
    "image_ids",
    "cache_state",
    "context",
    "namespace",
)
GUIDE_ROW_FIELDS = (
    "pod",
    "node",
    "image_id",
    "reward",
    "pod_to_ready_seconds",
    "batch_to_ready_seconds",
    "batch_to_reward_seconds",
)
