"""The top layer: the `rollout` command (`main.py`, its shared helpers in `common.py`, `run.py`,
`report.py`), the one-shot local stack, plots, the scripted policy server. Nothing below imports
this package; a `rollout worker` process loads only `main.py` and `common.py` of it (no rich,
matplotlib or trainer client: `tests/unit/test_layers.py`)."""
