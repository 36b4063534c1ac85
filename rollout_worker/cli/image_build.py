"""Running the image commands: each step of each task's image, with a failure told in one line
(a base image docker cannot get: the image named and the ways to provide it, not the build's
log), the checks that the build can start at all, and the root filesystem extracted once per
image id. `rollout tasks build` and `rollout tasks check` both build through `build_images`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from rollout_worker.backends.local.sandbox import MOUNT_POINTS, WORKDIR_SUFFIX, rootfs_dirname
from rollout_worker.cli.base_images import dockerfile_bases, missing_base, missing_base_message
from rollout_worker.cli.image_commands import (
    ROOTFS_MARKER_SUFFIX,
    build_argv,
    create_argv,
    docker_check_argv,
    export_argvs,
    image_id_argv,
    last_line,
    node_import_argvs,
    push_argvs,
    pushed_name,
    remove_argv,
    workdir_argv,
)


class StepFailed(Exception):
    """One step of one image failed: the message is the whole line to print."""


def _label(argv: list[str]) -> str:
    """What a failure line calls a command: its program and first plain word ("ctr images")."""
    words = [w for w in argv[1:] if w.isalpha()][:1]
    return " ".join([Path(argv[0]).name, *words])


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace")
    except OSError as exc:
        raise StepFailed(f"{argv[0]}: {exc.strerror or exc}") from exc
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise StepFailed(f"{_label(argv)} failed: {last_line(output)}")
    return done.stdout


def _pipe(first: list[str], second: list[str]) -> None:
    """first | second; either side failing fails the step, with its last line."""
    try:
        source = subprocess.Popen(first, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise StepFailed(f"{first[0]}: {exc.strerror or exc}") from exc
    assert source.stdout is not None and source.stderr is not None
    try:
        sink = subprocess.run(second, stdin=source.stdout, capture_output=True)
    except OSError as exc:
        source.kill()
        raise StepFailed(f"{second[0]}: {exc.strerror or exc}") from exc
    finally:
        # Ours closed, so the source gets SIGPIPE (not a hang) when the sink stopped early.
        source.stdout.close()
        source_err = source.stderr.read().decode(errors="replace")
        source.wait()
    if source.returncode != 0:
        raise StepFailed(f"{_label(first)} failed: {last_line(source_err)}")
    if sink.returncode != 0:
        output = (sink.stdout + sink.stderr).decode(errors="replace")
        raise StepFailed(f"{_label(second)} failed: {last_line(output)}")


def preflight(node_socket: str | None) -> list[str]:
    """Why the build cannot start at all (one line each): no docker, daemon down, no ctr."""
    problems = []
    if shutil.which("docker") is None:
        problems.append("docker is not on PATH: install the Docker client (and daemon)")
    else:
        try:
            _run(docker_check_argv())
        except StepFailed as exc:
            problems.append(f"the Docker daemon does not answer ({exc}): start it")
    if node_socket is not None:
        if shutil.which("ctr") is None:
            problems.append("ctr is not on PATH (--node-import needs containerd's ctr)")
        if not os.path.exists(node_socket):
            problems.append(
                f"no containerd socket at {node_socket}: is the real node up "
                "(hack/localkube/cluster.sh node-up)? [env ROLLOUT_NODE_CONTAINERD_STATE, "
                "ROLLOUT_LOCALKUBE_NODE_ID]"
            )
    return problems


def _build(image: str, context: Path) -> None:
    try:
        _run(build_argv(image, context))
    except StepFailed as exc:
        if not missing_base(str(exc)):
            raise
        bases = dockerfile_bases((context / "Dockerfile").read_text(errors="replace"))
        absent = [base for base in bases if not _have_image(base)]
        raise StepFailed(missing_base_message(image, bases, absent, str(exc))) from exc


def _have_image(name: str) -> bool:
    try:
        _run(image_id_argv(name))
    except StepFailed:
        return False
    return True


def _export_rootfs(image: str, rootfs: Path) -> tuple[Path, bool]:
    """The image's filesystem extracted under `rootfs` (once per image id); (path, fresh)."""
    dest = rootfs / rootfs_dirname(image)
    marker = rootfs / (rootfs_dirname(image) + ROOTFS_MARKER_SUFFIX)
    image_id = _run(image_id_argv(image)).strip()
    if dest.is_dir() and marker.is_file() and marker.read_text().strip() == image_id:
        return dest, False
    container = _run(create_argv(image)).strip()
    # Extracted beside, then renamed: a half-written tree is never taken for a finished one.
    partial = rootfs / f".{rootfs_dirname(image)}.partial-{os.getpid()}"
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        _pipe(*export_argvs(container, partial))
        for point in MOUNT_POINTS:  # what a sandbox mounts over the read-only root
            (partial / point).mkdir(exist_ok=True)
        workdir = _run(workdir_argv(image)).strip() or "/"
        marker.unlink(missing_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        partial.rename(dest)
        (rootfs / (rootfs_dirname(image) + WORKDIR_SUFFIX)).write_text(workdir + "\n")
        marker.write_text(image_id + "\n")
    except OSError as exc:
        raise StepFailed(f"extracting {image} into {dest}: {exc}") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        # A leftover stopped container costs nothing; the rootfs is what matters.
        with contextlib.suppress(StepFailed):
            _run(remove_argv(container))
    return dest, True


def build_images(
    images: Sequence[tuple[str, str, Path]],
    *,
    node_socket: str | None,
    registry: str | None,
    rootfs: Path | None,
    echo: Any = click.echo,
) -> list[str]:
    """Build each (image, task id, context) and put it where asked; one line per failed task
    (`rollout tasks check` builds through here too, printing to stderr)."""
    failures = []
    for image, task_id, context in images:
        try:
            _build(image, context)
            echo(f"{task_id}: built {image}")
            if node_socket is not None:
                _pipe(*node_import_argvs(image, node_socket))
                echo(f"{task_id}: imported {image} into the node's containerd")
            if registry is not None:
                target = pushed_name(image, registry)
                for argv in push_argvs(image, target):
                    _run(argv)
                echo(f"{task_id}: pushed {target}")
            if rootfs is not None:
                path, fresh = _export_rootfs(image, rootfs)
                echo(f"{task_id}: rootfs {path}" + ("" if fresh else " (already there)"))
        except StepFailed as exc:
            failures.append(f"{task_id}: {exc}")
    return failures
