"""A task's artifacts (Harbor's top-level `artifacts`): mapped from task.toml and checked,
then read by the runner after the tests into the reward event, every byte hostile: bounded in
size and count, never through a link (the last component or any folder on the way), no FIFO
opened, binary kept as base64, each refusal named with why."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.harbor import scan
from rollout_wire.task_spec import check_artifacts
from tests.runner_program import episode
from tests.unit.test_agent_command import run_runner
from tests.unit.test_harbor import make_task


def collect(paths, root="/nonexistent-root"):
    return episode.collect_artifacts([str(p) for p in paths], str(root))


def test_files_are_kept_as_text_or_base64_with_their_size_and_hash(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\n")
    (tmp_path / "b.bin").write_bytes(b"\x00\xff\x01")
    found = collect([tmp_path / "a.txt", tmp_path / "b.bin"])
    assert found["artifacts_refused"] == []
    text, binary = found["artifacts"]
    assert text == {
        "path": str(tmp_path / "a.txt"),
        "bytes": len("héllo\n".encode()),
        "sha256": hashlib.sha256("héllo\n".encode()).hexdigest(),
        "text": "héllo\n",
    }
    assert base64.b64decode(binary["base64"]) == b"\x00\xff\x01" and "text" not in binary


def test_links_are_never_followed_anywhere_on_the_way(tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("not yours")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pw").symlink_to(secret)
    (tmp_path / "via").symlink_to(tmp_path)
    found = collect([tmp_path / "out" / "pw", tmp_path / "via" / "host-secret"])
    assert found["artifacts"] == []
    assert found["artifacts_refused"] == [
        f"{tmp_path}/out/pw: a symbolic link (never followed)",
        f"{tmp_path}/via/host-secret: a folder on the way is a symbolic link (never followed) "
        "or no folder",
    ]


def test_a_folder_is_walked_its_links_fifos_and_depth_refused_by_name(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "x.txt").write_text("x")
    (out / "link").symlink_to("/etc/passwd")
    os.mkfifo(out / "pipe")
    (out / "bad\nname").write_text("y")
    deep = out
    for level in range(episode.MAX_ARTIFACT_DEPTH + 1):
        deep = deep / f"d{level}"
    deep.mkdir(parents=True)
    (deep / "far.txt").write_text("far")
    found = collect([out])
    assert sorted(a["path"] for a in found["artifacts"]) == [
        f"{out}/bad\\nname",  # escaped: a name starts no line of its own
        f"{out}/sub/x.txt",
    ]
    refused = found["artifacts_refused"]
    assert f"{out}/link: a symbolic link (never followed)" in refused
    assert f"{out}/pipe: not a file or folder (a FIFO, socket or device is never opened)" in refused
    assert any("deeper than the 8 folders walked" in line for line in refused), refused


def test_sizes_and_counts_are_bounded(tmp_path):
    (tmp_path / "big").write_bytes(b"a" * (episode.MAX_ARTIFACT_FILE_BYTES + 1))
    many = tmp_path / "many"
    many.mkdir()
    for i in range(episode.MAX_ARTIFACT_FILES + 2):
        (many / f"f{i:03}").write_text("z")
    found = collect([tmp_path / "big", many])
    assert len(found["artifacts"]) == episode.MAX_ARTIFACT_FILES
    assert found["artifacts_refused"][0] == (
        f"{tmp_path}/big: 262145 bytes, above the 262144 a file may have"
    )
    assert found["artifacts_refused"][1:] == [
        f"{many}/f050: over the 50 files an episode keeps",
        f"{many}/f051: over the 50 files an episode keeps",
    ]
    total = tmp_path / "total"
    total.mkdir()
    for i in range(5):
        (total / f"t{i}").write_bytes(b"b" * episode.MAX_ARTIFACT_FILE_BYTES)
    found = collect([total])
    assert len(found["artifacts"]) == 4  # 4 x 256 KiB = the 1 MiB an episode keeps
    assert found["artifacts_refused"] == [
        f"{total}/t4: over the 1048576 bytes an episode's artifacts keep"
    ]


def test_a_relative_path_is_the_workspaces_and_a_missing_one_is_named(tmp_path):
    (tmp_path / "result.txt").write_text("r")
    found = collect(["result.txt", "absent.txt"], root=tmp_path)
    assert [a["text"] for a in found["artifacts"]] == ["r"]
    assert found["artifacts_refused"] == ["absent.txt: No such file or directory"]


def test_the_runner_puts_them_in_the_reward_event_after_the_tests(tmp_path):
    task = {
        "id": "t",
        "statement": "s",
        "files": {},
        "test_command": ["bash", "-c", "echo made-by-tests > tests-wrote.txt"],
        "agent": "oracle",
        "solution": {"solve.sh": "echo made-by-oracle > out.txt\n"},
        "baseline": False,
        "artifacts": ["out.txt", "tests-wrote.txt", "nothing-here"],
    }
    _, events = run_runner(tmp_path, task)
    (reward,) = [e for e in events if e["event"] == "reward"]
    assert [(a["path"], a["text"]) for a in reward["artifacts"]] == [
        ("out.txt", "made-by-oracle\n"),
        ("tests-wrote.txt", "made-by-tests\n"),
    ]
    assert reward["artifacts_refused"] == ["nothing-here: No such file or directory"]
    (tmp_path / "plain").mkdir()
    plain = {k: v for k, v in task.items() if k != "artifacts"}
    _, events = run_runner(tmp_path / "plain", plain)
    (reward,) = [e for e in events if e["event"] == "reward"]
    assert "artifacts" not in reward and "artifacts_refused" not in reward


def test_harbors_list_maps_onto_the_task_and_what_is_not_honoured_is_refused(tmp_path):
    make_task(
        tmp_path / "ok", "ok", toml='artifacts = ["/logs/agent/out.txt", { source = "res" }]\n'
    )
    assert scan(tmp_path / "ok")[0].task["artifacts"] == ["/logs/agent/out.txt", "res"]
    make_task(
        tmp_path / "bad",
        "bad",
        toml='artifacts = [{ source = "/x", destination = "y" }, "/proc/1/environ", "../up"]\n',
    )
    with pytest.raises(InvalidSpec) as refused:
        scan(tmp_path / "bad")
    said = str(refused.value)
    assert "artifacts entry '/x': keys ['destination'] are not honoured" in said
    assert "artifacts: '/proc/1/environ' must be a path" in said
    assert "artifacts: '../up' must be a path" in said


@pytest.mark.parametrize("paths", [["/"], ["a\0b"], ["x" * 257], [3], "out.txt", ["p"] * 21])
def test_task_paths_are_bounded(paths):
    problems: list[str] = []
    check_artifacts(paths, "artifacts", problems)
    assert len(problems) == 1, problems
