"""Deleting a local run survives its worker being killed mid-way: the run is renamed (by a name
carrying its run_uid, given only once run.json proved it ours) before it is removed, so a
redelivered deletion finishes it instead of meeting a folder whose run.json is already gone
(CI, 2026-12-05: a prefork child killed during rmtree left such a folder, refused for good)."""

from __future__ import annotations

import sys

import orjson
import pytest

from rollout_wire.errors import OwnershipError
from rollout_worker.backends.base import LocalRunHandle
from rollout_worker.backends.local import backend as local
from rollout_worker.settings import Settings


def setup(tmp_path):
    root = tmp_path / "runs"
    run = root / "b1"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "0.log").write_text("x")
    (run / "run.json").write_bytes(orjson.dumps({"owner": local.OWNER, "run_uid": "u1"}))
    backend = local.LocalBackend(Settings(local_root=root, local_python=sys.executable))
    handle = LocalRunHandle(
        backend="local", batch_id="b1", origin=0.0, episode_prefix="r", context="local:x",
        run_dir=str(run), run_uid="u1",
    )  # fmt: skip
    return backend, handle, root, run


def test_a_deletion_leaves_nothing_behind(tmp_path):
    backend, handle, root, _ = setup(tmp_path)
    assert backend.delete_run(handle) is True
    assert list(root.iterdir()) == []


def test_a_deletion_cut_short_after_the_rename_is_finished_by_the_next_one(tmp_path):
    backend, handle, root, run = setup(tmp_path)
    doomed = root / ".deleting-b1-u1"
    run.rename(doomed)  # what the killed deletion did first
    (doomed / "run.json").unlink()  # and rmtree had begun
    assert backend.delete_run(handle) is True
    assert list(root.iterdir()) == []


def test_a_folder_without_run_json_under_the_run_name_is_still_refused(tmp_path):
    backend, handle, _, run = setup(tmp_path)
    (run / "run.json").unlink()
    with pytest.raises(OwnershipError, match=r"no run\.json of ours"):
        backend.delete_run(handle)
    assert (run / "logs" / "0.log").exists()
