"""bench_grading --real-node only: a worker started with this folder first on PYTHONPATH and
ROLLOUT_BENCH_PROGRAM naming a file runs that file as the episode program (another revision's,
for an A/B on the real node). Replaced before any backend imports it, so the Kubernetes
backend's ConfigMaps carry it."""

import os

_path = os.environ.get("ROLLOUT_BENCH_PROGRAM")
if _path:
    import rollout_worker.sandbox as _sandbox

    with open(_path, encoding="utf-8") as _handle:
        _text = _handle.read()
    _sandbox.episode_program_text = lambda: _text
