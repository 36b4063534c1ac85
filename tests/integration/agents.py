"""How the tests run mini-swe-agent (installed by hack/agent-envs.sh or, for the real node,
hack/agent-image.sh): offline and without a terminal. Its defaults ask questions and fetch a
price list; these settings are what its own docs and source say turn that off."""

from __future__ import annotations

from pathlib import Path

MINI_ENV = {
    "MSWEA_CONFIGURED": "true",
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mswea",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_OFFLINE_MODE": "true",
}


def mini_command(env: Path | str) -> list[str]:
    """mini-swe-agent of the virtual environment `env` on the episode's statement."""
    line = (
        f"exec {env}/bin/mini -c mini.yaml -c agent.agent_class=default "
        "-c agent.step_limit=20 -c agent.cost_limit=0 -c model.model_name=openai/$OPENAI_MODEL "
        "-c model.cost_tracking=ignore_errors -c environment.environment_class=local "
        '-c environment.timeout=60 -t "$ROLLOUT_STATEMENT" -o /tmp/traj.json </dev/null'
    )
    return ["sh", "-c", line]
