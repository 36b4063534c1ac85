"""A local run's document (run.json) and its episode program, as a supervisor reads them.

Built by the local backend for its own supervisor, and by the host backend for the sandbox
hosts, which write it into their own run folder (backends/host/run.py) with their own machine's
fields (`machine_fields`)."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from rollout_wire.request import BatchSpec
from rollout_worker.backends.local.files import OWNER
from rollout_worker.sandbox import compile_program, compiled_path, episode_program_text


@functools.lru_cache(maxsize=4)
def describe_python(python: str) -> tuple[str, str]:
    """(sys.base_prefix, an image-id-like identity) of the sandbox interpreter."""
    done = subprocess.run(
        [
            python,
            "-c",
            "import sys, platform; print(sys.base_prefix); print(platform.python_version())",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    prefix, version = done.stdout.split()
    real = os.path.realpath(python)
    digest = hashlib.sha256(Path(real).read_bytes()).hexdigest()[:16]
    return prefix, f"local://{real}@python{version}:sha256-{digest}"


@functools.lru_cache(maxsize=1)
def program_sha() -> str:
    """The episode program's identity: a host runs a batch only with the program its workers
    have (a rolling upgrade's two generations must not mix)."""
    return hashlib.sha256(episode_program_text().encode()).hexdigest()


def machine_fields(*, isolation: str, python: str, rootfs_dir: Path | str, node: str) -> dict:
    """The fields of run.json that belong to the machine that runs the sandboxes."""
    prefix, image_id = describe_python(python)
    return {
        "isolation": isolation,
        "python": python,
        "python_prefix": prefix,
        "image_id": image_id,
        "rootfs_dir": str(rootfs_dir),
        "node": node,
    }


def progress_fields(batch_id: str, redis_url: str, ttl: int) -> dict[str, Any]:
    """Where the supervisor streams progress and done signals (local/reporter.py)."""
    return {"redis_url": redis_url, "batch_id": batch_id, "ttl": ttl}


def run_document(
    spec: BatchSpec,
    *,
    isolation: str,
    python: str,
    rootfs_dir: Path | str,
    node: str,
    redis_url: str,
    record_ttl: int,
) -> dict[str, Any]:
    """run.json for a new run of `spec` (its run_uid and created_at made here)."""
    # Here, not at the top: quantities loads the kubernetes client's parser, which a sandbox
    # host (that only reads run documents) must not load.
    from rollout_worker.quantities import sandbox_limits, storage_bytes

    memory_bytes, cpu_seconds = sandbox_limits(spec.resources, spec.episode_timeout_seconds)
    return {
        "owner": OWNER,
        "batch_id": spec.batch_id,
        "run_uid": uuid.uuid4().hex,
        "created_at": time.time(),
        "spec": spec.to_dict(),
        "limits": {
            "memory_bytes": memory_bytes,
            "cpu_seconds": cpu_seconds,
            "storage_bytes": storage_bytes(spec.resources),
        },
        "episode_prefix": f"rollout-{spec.batch_id}",
        **machine_fields(isolation=isolation, python=python, rootfs_dir=rootfs_dir, node=node),
        "progress": progress_fields(spec.batch_id, redis_url, record_ttl),
    }


def write_program(path: Path, python: str) -> None:
    """The episode program, readable by the sandboxes, written once (atomically), and its
    bytecode for the sandboxes' interpreter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(episode_program_text())
        tmp.chmod(0o644)
        os.replace(tmp, path)
    if not compiled_path(path).exists():
        compile_program(path, python)
