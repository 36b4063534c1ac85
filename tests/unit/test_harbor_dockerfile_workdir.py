"""A Harbor task without [environment] workdir whose environment/Dockerfile sets WORKDIR works
in that folder on both backends: the Dockerfile's last literal, absolute WORKDIR (of its final
stage) becomes the task's `workdir`; anything that needs the build to know is left unset."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.harbor import scan
from rollout_wire.harbor_files import dockerfile_workdir
from tests.unit.test_harbor import make_task

DATA = Path(__file__).resolve().parents[1] / "data" / "harbor"


@pytest.mark.parametrize(
    ("dockerfile", "workdir"),
    [
        ("FROM x\nWORKDIR /app\n", "/app"),
        ("FROM x\nWORKDIR /a\nRUN true\nworkdir /srv/b/\n", "/srv/b"),
        ("FROM x\nWORKDIR \\\n  /joined\n", "/joined"),
        ("FROM x\nRUN true\n", None),
        ("FROM x\nWORKDIR /\n", None),
        ("FROM x\nARG D=/app\nWORKDIR $D\n", None),
        ("FROM x\nWORKDIR /app/${SUB}\n", None),
        ("FROM x\nWORKDIR /app\nWORKDIR relative\n", None),
        ('FROM x\nWORKDIR "/app"\n', None),
        # A later stage starts from its base's WORKDIR, which only the build knows.
        ("FROM x AS build\nWORKDIR /build\nFROM y\nCOPY --from=build /b /b\n", None),
        ("FROM x AS build\nWORKDIR /build\nFROM y\nWORKDIR /final\n", "/final"),
    ],
)
def test_the_dockerfile_workdir_is_its_last_literal_absolute_one(dockerfile, workdir):
    assert dockerfile_workdir(dockerfile) == workdir


def test_an_own_image_task_takes_its_dockerfiles_workdir(tmp_path):
    make_task(tmp_path, "t", environment={"Dockerfile": "FROM base\nWORKDIR /app\n"})
    assert scan(tmp_path / "t")[0].task["workdir"] == "/app"


def test_the_fixture_image_task_works_in_app():
    (mapped,) = scan(DATA, ["image-task"])
    assert mapped.task["workdir"] == "/app"


def test_environment_workdir_wins_over_the_dockerfile(tmp_path):
    make_task(
        tmp_path,
        "t",
        toml='[environment]\nworkdir = "/custom"\n',
        environment={"Dockerfile": "FROM base\nWORKDIR /app\n"},
    )
    assert scan(tmp_path / "t")[0].task["workdir"] == "/custom"


def test_no_literal_workdir_leaves_it_unset(tmp_path):
    make_task(tmp_path, "t", environment={"Dockerfile": "FROM base\nARG D\nWORKDIR $D\n"})
    assert "workdir" not in scan(tmp_path / "t")[0].task


def test_a_files_task_has_no_workdir_from_a_dockerfile_it_lacks(tmp_path):
    make_task(tmp_path, "t", environment={"app.py": "WORKDIR /app\n"})
    assert "workdir" not in scan(tmp_path / "t")[0].task


def test_a_dockerfile_workdir_is_validated_like_the_key(tmp_path):
    make_task(tmp_path, "t", environment={"Dockerfile": "FROM base\nWORKDIR /tmp/work\n"})
    with pytest.raises(InvalidSpec) as info:
        scan(tmp_path / "t")
    assert "environment/Dockerfile WORKDIR '/tmp/work' must be an absolute path" in str(
        info.value.problems
    )
