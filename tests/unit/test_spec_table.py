"""`parse_spec` is a table of field parsers: every BatchSpec field is read by exactly one."""

from __future__ import annotations

from dataclasses import fields

from rollout_wire.request import FIELD_NAMES, BatchSpec


def test_the_table_reads_every_field_of_a_batch_spec_once():
    assert sorted(FIELD_NAMES) == sorted(f.name for f in fields(BatchSpec))
    assert len(FIELD_NAMES) == len(set(FIELD_NAMES))
