"""How the tests run mini-swe-agent (installed by hack/agent-envs.sh or, for the real node,
hack/agent-image.sh): offline and without a terminal. Its defaults ask questions and fetch a
price list; these settings are what its own docs and source say turn that off.

Both install into the same folder with the same interpreter (:data:`AGENT_ENVS`,
:data:`AGENT_PYTHON`), so a session installs the agents from PyPI once: the local sandboxes run
the environments hack/agent-image.sh copies into the real node's image."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: hack/agent-image.sh's AGENTS: the image holds this folder at the same path.
AGENT_ENVS = Path("/opt/rollout-agents")
#: The interpreter hack/agent-image.sh makes them with (the image's, and the local sandboxes'
#: default): a virtual environment only runs under the interpreter it was made with.
AGENT_PYTHON = "/usr/bin/python3"

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


def agent_envs() -> dict[str, Path]:
    """hack/agent-envs.sh into :data:`AGENT_ENVS` with :data:`AGENT_PYTHON`, as
    hack/agent-image.sh calls it (each environment is made once: a second call finds it)."""
    done = subprocess.run(
        [str(ROOT / "hack" / "agent-envs.sh"), str(AGENT_ENVS)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "ROLLOUT_LOCAL_PYTHON": AGENT_PYTHON},
    )
    assert done.returncode == 0, f"hack/agent-envs.sh failed: {done.stderr[-2000:]}"
    base = Path(done.stdout.strip().splitlines()[-1])
    assert base == AGENT_ENVS, base
    return {"openai": base / "openai", "mini": base / "mini"}
