"""The guide's records of a run, written to an output directory that must not exist yet."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import orjson

from rollout_wire.errors import OutputDirError

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_output_dir(path: Path) -> None:
    """Refuse an existing path (never overwrite an experiment) or an unwritable parent."""
    if path.exists() or path.is_symlink():
        raise OutputDirError(
            f"output directory {path} already exists; choose a new one "
            "(records are never overwritten)"
        )
    parent = path.absolute().parent
    if not parent.is_dir():
        raise OutputDirError(f"parent directory {parent} of --output does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputDirError(f"parent directory {parent} of --output is not writable")


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n"


def start_records(path: Path, receipt: dict[str, Any]) -> None:
    """Create the directory and the receipt before anything is submitted."""
    check_output_dir(path)
    path.mkdir()
    write_receipt(path, receipt)


def discard_records(path: Path) -> None:
    """Undo `start_records` when the batch could not be sent: remove the receipt and the
    directory this command created, so the same command can run again. A directory holding
    anything else is left as it is (never delete what someone else put there)."""
    for name in ("receipt.json", ".receipt.json.tmp"):
        with contextlib.suppress(FileNotFoundError):
            (path / name).unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


def write_receipt(path: Path, receipt: dict[str, Any]) -> None:
    tmp = path / ".receipt.json.tmp"
    tmp.write_bytes(_json(receipt))
    os.replace(tmp, path / "receipt.json")


def write_records(
    path: Path,
    report: dict[str, Any],
    logs: dict[int, str],
    records: dict[str, str],
    submit_to_report_seconds: float | None,
    client_job_complete_seconds: float | None = None,
) -> list[str]:
    """results.json (the report, plus this client's own clock: submit -> report seen, and the
    guide's `client_job_complete_seconds`, submit -> this client saw the run complete,
    polling included), one log per episode (<pod>.log), and the backend's records."""
    written = []
    results = report | {
        "client_submit_to_report_seconds": submit_to_report_seconds,
        "client_job_complete_seconds": client_job_complete_seconds,
    }
    (path / "results.json").write_bytes(_json(results))
    written.append("results.json")
    pods = {row["index"]: row["pod"] for row in report.get("pods", [])}
    for index, text in sorted(logs.items()):
        name = f"{pods.get(index, f'episode-{index}')}.log"
        if _SAFE_NAME.match(name):
            (path / name).write_text(text)
            written.append(name)
    for name, text in sorted(records.items()):
        if _SAFE_NAME.match(name) and name not in ("results.json", "receipt.json"):
            (path / name).write_text(text)
            written.append(name)
    return written
