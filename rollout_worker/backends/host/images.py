"""A sandbox host's task images (issue 46): the roots under its --rootfs (Kubernetes image
volumes, read-only, or `rollout tasks build --rootfs` exports) and each one's WORKDIR file,
which an image volume does not carry, so the pool names it (--image-workdir)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rollout_worker.backends.local.sandbox import WORKDIR_SUFFIX, rootfs_dirname


def carried_images(rootfs_dir: Path) -> list[str]:
    """The task images' root filesystems here, by their folder names (sandbox.rootfs_dirname)."""
    if not rootfs_dir.is_dir():
        return []
    return sorted(
        path.name
        for path in rootfs_dir.iterdir()
        if path.is_dir() and (rootfs_dir / (path.name + WORKDIR_SUFFIX)).is_file()
    )


def write_workdirs(rootfs_dir: Path, workdirs: list[tuple[str, str]]) -> list[str]:
    """Each mounted image's WORKDIR beside its root, as `rollout tasks build --rootfs` leaves
    it: an image volume has no image config to read it from (the pool says it). The images
    whose root is not there (not told in the heartbeat: their batches are refused)."""
    missing = []
    for image, workdir in workdirs:
        path = rootfs_dir / (rootfs_dirname(image) + WORKDIR_SUFFIX)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(workdir + "\n")
        partial.replace(path)
        if not (rootfs_dir / rootfs_dirname(image)).is_dir():
            missing.append(image)
    return missing


def image_workdir(text: str) -> tuple[str, str]:
    """`IMAGE=WORKDIR` (no image reference holds "=")."""
    image, sep, workdir = text.partition("=")
    if not image or not sep or not workdir.startswith("/"):
        raise argparse.ArgumentTypeError(f"not IMAGE=/WORKDIR: {text!r}")
    return image, workdir
