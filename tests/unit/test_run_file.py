"""run.json as the local backend writes it and a sandbox host rewrites it: the machine's own
fields are one group that a host replaces, the batch's fields are the workers'."""

from __future__ import annotations

import sys

from rollout_wire.request import BatchSpec, parse_spec
from rollout_worker.backends.local.files import OWNER
from rollout_worker.backends.local.run_file import (
    describe_python,
    machine_fields,
    program_sha,
    run_document,
    write_program,
)
from rollout_worker.sandbox import compiled_path, episode_program_text


def test_the_run_document_holds_the_batch_and_the_machine_it_runs_on(tmp_path):
    spec = parse_spec({"count": 3, "backend": "local"}, max_episodes=10)
    run = run_document(
        spec,
        isolation="bwrap",
        python=sys.executable,
        rootfs_dir=tmp_path,
        node="n1",
        redis_url="redis://r:6379/0",
        record_ttl=60,
    )
    assert (run["owner"], run["batch_id"]) == (OWNER, spec.batch_id)
    assert BatchSpec.from_dict(run["spec"]) == spec
    assert run["episode_prefix"] == f"rollout-{spec.batch_id}"
    assert set(run["limits"]) == {"memory_bytes", "cpu_seconds", "storage_bytes"}
    assert run["progress"] == {
        "redis_url": "redis://r:6379/0",
        "batch_id": spec.batch_id,
        "ttl": 60,
    }
    machine = machine_fields(
        isolation="bwrap", python=sys.executable, rootfs_dir=tmp_path, node="n1"
    )
    assert {key: run[key] for key in machine} == machine
    assert (run["python_prefix"], run["image_id"]) == describe_python(sys.executable)


def test_the_program_is_written_once_with_its_bytecode(tmp_path):
    program = tmp_path / "program" / "episode.py"
    write_program(program, sys.executable)
    assert program.read_text() == episode_program_text()
    assert compiled_path(program).exists()
    assert len(program_sha()) == 64
