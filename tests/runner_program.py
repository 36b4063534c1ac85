"""The episode program as it ships (rollout_worker.sandbox.episode_program_text), loaded as a
module: tests call and monkeypatch the code sandboxes run, in its one namespace, not the
runner package's pieces. Written to a file first: the program reads its own source (the test
harness, harness_source)."""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from rollout_worker.sandbox import episode_program_text
from rollout_worker.sandbox.program import LAZY_MODULES

MODULE_NAME = "rollout_episode_program"


def load_program() -> ModuleType:
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    folder = Path(tempfile.mkdtemp(prefix="rollout-program-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "episode.py"
    path.write_text(episode_program_text(), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # before it runs, as an import would
    spec.loader.exec_module(module)
    for name in LAZY_MODULES:  # every name at hand (test_runner_program runs them lazily)
        module.lazy_module(name)
    return module


episode = load_program()
