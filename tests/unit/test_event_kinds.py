"""The runner's event names are `rollout_wire.states.EventKind`: the runner ships alone
(standard library only) and cannot import the enum, so its source is read here."""

from __future__ import annotations

import ast
import re

from rollout_wire.states import FINAL_EVENTS, EventKind
from rollout_worker.sandbox import episode_program_text

# Every event the runner prints goes through `emit("<kind>", ...)`.
_EMITTED = re.compile(r"\bemit\(\s*\"([a-z_]+)\"")


def test_the_runner_emits_exactly_the_event_kinds():
    emitted = set(_EMITTED.findall(episode_program_text()))
    assert emitted == {kind.value for kind in EventKind}


def test_the_runner_ends_a_sandbox_on_the_same_final_events():
    program = ast.parse(episode_program_text())
    found = [
        ast.literal_eval(node.value)
        for node in ast.walk(program)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "FINAL_EVENTS" for t in node.targets)
    ]
    assert found == [tuple(kind.value for kind in FINAL_EVENTS)]
