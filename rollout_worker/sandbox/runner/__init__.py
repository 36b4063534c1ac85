"""One RL episode in a sandbox: prepare the task, let the agent act, test, report a reward.

Runs with any Python >= 3.9 and only the standard library, as an unprivileged user, in its
own workspace; its stdout carries the JSON events the workers validate, one per line. The
modes, events, exit codes and environment are specified in docs/runner-events.md. Written as
the package rollout_worker/sandbox/runner/, shipped as one file built from it
(rollout_worker/sandbox/program.py).
"""
