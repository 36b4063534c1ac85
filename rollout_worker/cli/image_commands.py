"""The commands that build a Harbor task's image and put it where a backend finds it, as argv
lists (pure, tested without Docker): `docker build`, the import into the local cluster's real
node, the push to a registry, the export of a root filesystem for the local backend, and the
whole plan `rollout tasks build --dry-run` prints. `image_build` runs them.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout_worker.backends.local.sandbox import rootfs_dirname

# hack/localkube/node.sh: the real node's private containerd listens on
# ${ROLLOUT_NODE_CONTAINERD_STATE:-/run/rollout-containerd2<suffix>}/containerd.sock, where the
# suffix is "-N" for ROLLOUT_LOCALKUBE_NODE_ID=N (1..200) and empty for the default node 0;
# the kubelet's images live in containerd's `k8s.io` namespace.
CONTAINERD_NAMESPACE = "k8s.io"
MAX_NODE_ID = 200
# Written next to an extracted root filesystem: the id of the image it came from.
ROOTFS_MARKER_SUFFIX = ".image-id"


def containerd_socket(environ: Mapping[str, str] | None = None) -> str:
    """The socket of the local cluster's real node, as hack/localkube/node.sh names it."""
    env = os.environ if environ is None else environ
    state = env.get("ROLLOUT_NODE_CONTAINERD_STATE")
    if not state:
        node_id = env.get("ROLLOUT_LOCALKUBE_NODE_ID") or "0"
        if not node_id.isdigit() or int(node_id) > MAX_NODE_ID:
            raise ValueError(f"ROLLOUT_LOCALKUBE_NODE_ID must be 0..{MAX_NODE_ID}, not {node_id!r}")
        suffix = "" if int(node_id) == 0 else f"-{node_id}"
        state = f"/run/rollout-containerd2{suffix}"
    return f"{state}/containerd.sock"


def docker_check_argv() -> list[str]:
    # Fails unless the daemon answers (the client alone prints its own version).
    return ["docker", "version", "--format", "{{.Server.Version}}"]


def build_argv(image: str, context: Path) -> list[str]:
    return ["docker", "build", "-t", image, str(context)]


def node_import_argvs(image: str, socket: str) -> tuple[list[str], list[str]]:
    """`docker save IMAGE | ctr ... images import -`: the two sides of the pipe."""
    return (
        ["docker", "save", image],
        ["ctr", "--address", socket, "--namespace", CONTAINERD_NAMESPACE, "images", "import", "-"],
    )


def check_registry(registry: str) -> str:
    """REGISTRY[/path] without a trailing '/'; ValueError for a URL or nothing."""
    if not registry.strip("/") or "://" in registry or any(c.isspace() for c in registry):
        raise ValueError(
            f"--push {registry!r} must be a registry (and path) like 'registry.example.com:5000/"
            "team', without a scheme"
        )
    return registry.rstrip("/")


def pushed_name(image: str, registry: str) -> str:
    """REGISTRY/<name:tag>: the local prefix (rollout.local/) swapped for the registry."""
    from rollout_wire.harbor import LOCAL_REGISTRY

    return f"{check_registry(registry)}/{image.removeprefix(LOCAL_REGISTRY + '/')}"


def push_argvs(image: str, target: str) -> list[list[str]]:
    return [["docker", "tag", image, target], ["docker", "push", target]]


def workdir_argv(image: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{.Config.WorkingDir}}", image]


def image_id_argv(image: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", "{{.Id}}", image]


def create_argv(image: str) -> list[str]:
    # A container is only created (never started) to export its filesystem; the command is
    # required for images without CMD, and never runs.
    return ["docker", "create", image, "/bin/true"]


def export_argvs(container: str, dest: Path) -> tuple[list[str], list[str]]:
    """`docker export C | tar -x -C DEST`: the two sides of the pipe. /dev is left out (device
    nodes need root to create; the sandbox gets its own /dev)."""
    return (
        ["docker", "export", container],
        [
            "tar",
            "-x",
            "-f",
            "-",
            "-C",
            str(dest),
            "--anchored",
            "--exclude=dev/*",
            "--exclude=./dev/*",
        ],
    )


def remove_argv(container: str) -> list[str]:
    return ["docker", "rm", "-f", container]


def last_line(output: str) -> str:
    """The last non-empty line of a command's output: what a one-line failure shows."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


@dataclass(frozen=True)
class Step:
    """One command of a build plan (`--dry-run` prints them)."""

    task_id: str
    argv: list[str]
    pipe_to: list[str] | None = None

    def text(self) -> str:
        line = shlex.join(self.argv)
        return f"{line} | {shlex.join(self.pipe_to)}" if self.pipe_to else line


def plan(
    images: Sequence[tuple[str, str, Path]],
    *,
    node_socket: str | None,
    registry: str | None,
    rootfs: Path | None,
) -> list[Step]:
    """Every command `build` runs, in order (rootfs: its container id shown as <container>)."""
    steps: list[Step] = []
    for image, task_id, context in images:
        steps.append(Step(task_id, build_argv(image, context)))
        if node_socket is not None:
            save, load = node_import_argvs(image, node_socket)
            steps.append(Step(task_id, save, load))
        if registry is not None:
            target = pushed_name(image, registry)
            steps += [Step(task_id, argv) for argv in push_argvs(image, target)]
        if rootfs is not None:
            dest = rootfs / rootfs_dirname(image)
            steps.append(Step(task_id, create_argv(image)))
            export, extract = export_argvs("<container>", dest)
            steps.append(Step(task_id, export, extract))
            steps.append(Step(task_id, remove_argv("<container>")))
    return steps
