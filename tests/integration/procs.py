"""What of a local run still runs on this machine (read from /proc)."""

from __future__ import annotations

from pathlib import Path

# The run's supervisor names the run directory too; it is not a sandbox.
SUPERVISOR_MODULE = b"rollout_worker.backends.local.supervisor"


def sandbox_processes(run_dir: Path) -> list[int]:
    """Pids of the processes whose command line names `run_dir`, its supervisor left out."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if str(run_dir).encode() in cmdline and SUPERVISOR_MODULE not in cmdline:
                found.append(int(proc.name))
    return found
