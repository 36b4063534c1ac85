"""The runner's event names are `rollout_wire.states.EventKind`: the runner ships alone
(standard library only) and cannot import the enum, so its source is read here."""

from __future__ import annotations

import ast
import json
import re

from rollout_wire.states import EVENT_KEY_MARK, FINAL_EVENTS, EventKind, event_mark
from rollout_worker.sandbox import episode_program_text

# Every event the runner prints goes through `emit("<kind>", ...)`, or `event_line("<kind>", ...)`
# (a step event, serialised once and written as it is).
_EMITTED = re.compile(r"\b(?:emit|event_line)\(\s*\"([a-z_]+)\"")


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


def test_readers_of_raw_log_bytes_spell_an_event_as_the_runner_prints_it():
    # The runner writes json.dumps(record) with the default separators; the local supervisor
    # and the pool's hand-over search the raw bytes for these marks.
    assert "json.dumps(record, allow_nan=False)" in episode_program_text()
    for kind in EventKind:
        line = json.dumps({"event": kind.value, "at": 1.5, "episode_id": "e-0"})
        assert event_mark(kind) in line and EVENT_KEY_MARK in line
    assert event_mark(EventKind.READY) == '"event": "ready"'
