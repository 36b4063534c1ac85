"""Programs that run inside a sandbox (shipped as package data, run by every backend)."""

from importlib import resources

EPISODE_PROGRAM = "episode.py"


def episode_program_text() -> str:
    return resources.files(__name__).joinpath(EPISODE_PROGRAM).read_text(encoding="utf-8")
