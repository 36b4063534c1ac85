"""Rollout worker: runs batches of sandboxed RL episodes through Celery and Redis.

Its floors, lowest first, are written once where they are enforced: `FLOORS` in
`tests/unit/test_layers.py` (imports point down only, no circle, no module past 600 lines).
docs/architecture.md walks a newcomer through them.
"""

__version__ = "0.1.0"
