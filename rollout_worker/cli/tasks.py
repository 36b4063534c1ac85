"""`rollout tasks`: look at a task set, and build the images of Harbor tasks.

`show REF` prints what a batch would carry (REF: a Harbor folder, a JSON task set or "bundled").
`build DIR` runs `docker build` for every Harbor task with an environment/Dockerfile, under the
name the mapping gave it (`rollout_wire.harbor.local_image_name`), then optionally puts the
image where a backend finds it: the local cluster's real node (`--node-import`), a registry
(`--push`), or an extracted root filesystem for the local backend (`--rootfs`).
`check DIR` builds the same way, then runs every task's oracle (and with --nop an agent that
does nothing) and judges the rows (the verdict: `rollout_worker.cli.check`).

The commands are built by the pure functions below (argv lists, tested without Docker); the
click commands only run them. A base image docker cannot get (not local, no registry reached)
fails its task's build with the image named and the ways to provide it, not the build's log.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from rollout_wire.errors import InvalidSpec
from rollout_worker.backends.local.sandbox import MOUNT_POINTS, WORKDIR_SUFFIX, rootfs_dirname
from rollout_worker.cli import placement
from rollout_worker.cli.common import load_settings, redis_option

# -- the commands (pure) -----------------------------------------------------------------------

# hack/localkube/node.sh: the real node's private containerd listens on
# ${ROLLOUT_NODE_CONTAINERD_STATE:-/run/rollout-containerd<suffix>}/containerd.sock, where the
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
        state = f"/run/rollout-containerd{suffix}"
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


def dockerfile_lines(text: str) -> list[list[str]]:
    """A Dockerfile's instructions as words: continuation lines joined, comments dropped."""
    instructions: list[list[str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        words = (pending + line).split()
        pending = ""
        if words:
            instructions.append(words)
    if pending.split():
        instructions.append(pending.split())
    return instructions


# $NAME, ${NAME}, ${NAME:-default}, ${NAME:+word}: the forms an ARG takes in a FROM line.
_ARG_REF = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def substitute_args(word: str, args: Mapping[str, str]) -> str:
    """`word` with the build args' defaults put in (no --build-arg is ever passed here)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(4)
        value = args.get(name, "")
        if match.group(2) == "-":
            return value or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if value else ""
        return value

    return _ARG_REF.sub(one, word)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def dockerfile_bases(text: str) -> list[str]:
    """The images a Dockerfile needs from elsewhere: its FROM images and `COPY --from=IMAGE`
    sources, with the ARGs declared before the first FROM put in (the only ones a FROM sees);
    the stages it defines itself (by name or number) and `scratch` left out. A FROM whose ARG
    has no default stays as written (`${BASE}`), so a message can still name it."""
    bases: list[str] = []
    stages: set[str] = set()
    args: dict[str, str] = {}
    seen_from = 0  # FROM lines so far

    def add(word: str) -> None:
        image = substitute_args(word, args) or word
        if image.lower() in stages or image.lower() == "scratch" or image.isdigit():
            return
        if image not in bases:
            bases.append(image)

    for words in dockerfile_lines(text):
        op = words[0].upper()
        if op == "ARG" and seen_from == 0:
            for decl in words[1:]:
                name, eq, value = decl.partition("=")
                args[name] = _unquote(value) if eq else args.get(name, "")
        elif op == "FROM":
            rest = [w for w in words[1:] if not w.startswith("--")]
            stages.add(str(seen_from))  # `COPY --from=0` names the first stage
            seen_from += 1
            if not rest:
                continue
            add(rest[0])
            if len(rest) >= 3 and rest[1].upper() == "AS":
                stages.add(rest[2].lower())
        elif op in ("COPY", "ADD"):
            for word in words[1:]:
                if word.startswith("--from="):
                    add(word.removeprefix("--from="))
    return bases


# What docker says when a base image is not local and it tried (and failed) to fetch it.
_MISSING_BASE = re.compile(
    r"pull access denied|repository does not exist|manifest unknown|manifest for .* not found|"
    r"failed to resolve source metadata|no such host|failed to do request|"
    r"dial tcp|no match for platform|not found: not found",
    re.IGNORECASE,
)


def missing_base(output: str) -> bool:
    return bool(_MISSING_BASE.search(output))


# Docker's own registry: the one `registry-mirrors` (daemon.json) stands in for.
_DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


def registry_of(image: str) -> str:
    """Where Docker would pull `image` from: its first part when that names a host."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def missing_base_message(
    image: str, bases: Sequence[str], absent: Sequence[str], cause: str
) -> str:
    """What to tell the user when a build could not get a base image: which one, and the
    ways to provide it (a local tag, a saved copy, a mirror or a reachable registry)."""
    names = list(absent) or list(bases)
    lines = [f"docker build of {image}: cannot get its base image {', '.join(names) or '(none)'}"]
    if absent:
        lines[0] += " (not in the local Docker, and pulling it failed)"
    else:
        # Every base is local, yet docker went to a registry: an image for another platform
        # (FROM --platform=...) or a stage's source that the Dockerfile spells differently.
        lines[0] += " (in the local Docker, but docker still tried to pull: for another platform?)"
    lines[0] += f": {last_line(cause)}"
    for name in names:
        if "$" in name:
            lines.append(
                f"  {name}: a build arg without a default (no --build-arg is passed): give its "
                "ARG a default before the first FROM"
            )
            continue
        registry = registry_of(name)
        ways = [f"`docker tag <an image you have> {name}`", "or `docker load -i` a saved copy"]
        if registry in _DOCKER_HUB:
            ways.append(
                'or set a mirror of Docker Hub ("registry-mirrors" in /etc/docker/daemon.json, '
                "then restart dockerd)"
            )
        else:
            ways.append(f"or make {registry} reachable (`docker login {registry}` if it asks)")
        lines.append(f"  provide {name}: " + ", ".join(ways))
    return "\n".join(lines)


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


# -- running them ------------------------------------------------------------------------------


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


def _problems_exit(problems: Sequence[str]) -> NoReturn:
    for line in problems:
        click.echo(f"error: {line}", err=True)
    sys.exit(1)


# -- the commands ------------------------------------------------------------------------------


@click.group()
def tasks() -> None:
    """Show a task set; build the images of Harbor tasks; check every task's oracle."""


def summary_rows(task_list: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per task: id, statement's first line, image or files, tests, solution, limit."""
    from rollout_wire.request import DEFAULT_TASK_TIME_LIMIT_SECONDS

    rows = [["ID", "STATEMENT", "WORKSPACE", "TESTS", "SOLUTION", "LIMIT"]]
    for task in task_list:
        statement = str(task.get("statement") or "").strip()
        first = statement.splitlines()[0] if statement else ""
        if len(first) > 60:
            first = first[:57] + "..."
        files = len(task.get("files") or {})
        plural = "" if files == 1 else "s"
        workspace = f"image {task['image']}" if task.get("image") else f"{files} file{plural}"
        tests = len(task.get("tests") or task.get("test_files") or {})
        limit = task.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS)
        rows.append(
            [
                str(task.get("id")),
                first,
                workspace,
                str(tests),
                "yes" if "solve.sh" in (task.get("solution") or {}) else "no",
                f"{limit}s",
            ]
        )
    return rows


def format_rows(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


@tasks.command()
@click.argument("ref")
@click.option("--task", "only", multiple=True, help="Only this task id (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="The tasks as JSON (what a batch carries).")
def show(ref: str, only: tuple[str, ...], as_json: bool) -> None:
    """The tasks of REF: a Harbor task folder, a JSON task set, or "bundled"."""
    import orjson

    from rollout_wire.tasksets import load_task_set

    try:
        loaded = load_task_set(ref, list(only) or None)
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    if as_json:
        click.echo(orjson.dumps(loaded, option=orjson.OPT_INDENT_2).decode())
        return
    for line in format_rows(summary_rows(loaded)):
        click.echo(line)


@tasks.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--task", "only", multiple=True, help="Only this task id (repeatable).")
@click.option(
    "--node-import",
    is_flag=True,
    help="Load each image into the local cluster's real node (its containerd, k8s.io).",
)
@click.option(
    "--containerd-socket",
    "socket_path",
    default=None,
    help="For --node-import. [default: hack/localkube's, from ROLLOUT_NODE_CONTAINERD_STATE / "
    "ROLLOUT_LOCALKUBE_NODE_ID]",
)
@click.option(
    "--push",
    "registry",
    default=None,
    metavar="REGISTRY",
    help="Tag and push each image as REGISTRY/<name>:<tag> (prints the names).",
)
@click.option(
    "--rootfs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Extract each image's root filesystem under this folder (for the local backend).",
)
@click.option("--dry-run", is_flag=True, help="Print the commands; run nothing.")
def build(
    folder: Path,
    only: tuple[str, ...],
    node_import: bool,
    socket_path: str | None,
    registry: str | None,
    rootfs: Path | None,
    dry_run: bool,
) -> None:
    """Build the image of every Harbor task in FOLDER that has an environment/Dockerfile."""
    from rollout_wire import harbor

    try:
        mapped = harbor.scan(folder, list(only) or None)
        node_socket = (socket_path or containerd_socket()) if node_import else None
        if registry is not None:
            check_registry(registry)  # before anything is built
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    for h in mapped:
        if h.build_dir is None and h.task.get("image"):
            click.echo(f"{h.task_id}: uses the prebuilt image {h.task['image']} (nothing to build)")
    images = [(str(h.task["image"]), h.task_id, h.build_dir) for h in mapped if h.build_dir]
    if not images:
        click.echo(f"no task in {folder} has an environment/Dockerfile: nothing to build")
        return
    if rootfs is not None:
        rootfs = rootfs.resolve()
    if dry_run:
        for step in plan(images, node_socket=node_socket, registry=registry, rootfs=rootfs):
            click.echo(step.text())
        return
    problems = preflight(node_socket)
    if problems:
        _problems_exit(problems)
    failures = build_images(images, node_socket=node_socket, registry=registry, rootfs=rootfs)
    if failures:
        _problems_exit(failures)


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


@tasks.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--task", "only", multiple=True, help="Only this task id (repeatable).")
@click.option("--nop", is_flag=True, help="Also run an agent that does nothing: it must score 0.")
@click.option(
    "--allow-no-oracle",
    is_flag=True,
    help="A task without solution/solve.sh passes (shown as 'no oracle'). [default: it fails]",
)
@click.option(
    "--backend",
    type=click.Choice(["local", "kubernetes"]),
    default="local",
    show_default=True,
    help="Where the episodes run.",
)
@click.option(
    "--all-in-one/--no-all-in-one",
    default=None,
    help="Start a private redis-server and workers for the check. [default: on for local; "
    "off for kubernetes, which uses the workers at --redis-url]",
)
@click.option(
    "--rootfs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Local backend: where the images' root filesystems are exported. "
    "[default: ROLLOUT_ROOTFS_DIR, else the workers' default]",
)
@click.option(
    "--node-import",
    is_flag=True,
    help="Kubernetes: load each built image into the local cluster's real node.",
)
@click.option(
    "--episode-timeout",
    "episode_timeout_seconds",
    type=int,
    default=None,
    help="Seconds one episode may take. [default: the longest task's limit + 60, at least 120]",
)
@placement.options
@redis_option
def check(
    folder: Path,
    only: tuple[str, ...],
    nop: bool,
    allow_no_oracle: bool,
    backend: str,
    all_in_one: bool | None,
    rootfs: Path | None,
    node_import: bool,
    episode_timeout_seconds: int | None,
    redis_url: str | None,
    placement: dict[str, Any],
) -> None:
    """Check a Harbor task set before training on it: build what needs building, run every
    task's oracle (solution/solve.sh, which must score 1) and with --nop an agent that does
    nothing (which must score 0), and print a table. Exit status 1 when a task fails, 3 when
    only infrastructure failures kept tasks from being judged."""
    from rollout_wire import harbor
    from rollout_worker.cli import check as verdict

    settings = load_settings(redis_url)
    if all_in_one is None:
        all_in_one = backend == "local"
    try:
        mapped = harbor.scan(folder, list(only) or None)
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    task_list = [h.task for h in mapped]
    images = [(str(h.task["image"]), h.task_id, h.build_dir) for h in mapped if h.build_dir]
    build_errors: dict[str, str] = {}
    if backend == "local":
        rootfs = (rootfs or settings.rootfs_dir).resolve()
    if images:
        node_socket = containerd_socket() if node_import else None
        problems = preflight(node_socket)
        if problems:
            _problems_exit(problems)
        if rootfs is not None and not rootfs.exists():
            rootfs.mkdir(parents=True)
            rootfs.chmod(0o755)  # the sandboxes run as another host user
        failures = build_images(
            images,
            node_socket=node_socket,
            registry=None,
            rootfs=rootfs if backend == "local" else None,
            echo=lambda line: click.echo(line, err=True),
        )
        for line in failures:
            task_id, _, why = line.partition(": ")
            build_errors[task_id] = why
            click.echo(f"error: {line}", err=True)
    runnable = [t for t in task_list if str(t["id"]) not in build_errors]
    episode_timeout, deadline = verdict.limits(runnable)
    if episode_timeout_seconds is not None:
        episode_timeout = episode_timeout_seconds
        deadline = max(deadline, episode_timeout + verdict.DEADLINE_MARGIN_SECONDS)
    requests = {}
    common = {
        "backend": backend,
        "episode_timeout_seconds": episode_timeout,
        "deadline_seconds": deadline,
        **placement,
    }
    if oracle_list := verdict.oracle_tasks(runnable):
        requests["oracle"] = common | {"tasks": oracle_list}
    if nop and runnable:
        nop_list = verdict.nop_tasks(runnable)
        requests["nop"] = common | {"tasks": nop_list, "policy": verdict.NEVER_ASKED_POLICY}
    reports = _run_check_batches(requests, settings, all_in_one, rootfs)
    checks = verdict.collect(task_list, reports.get("oracle"), reports.get("nop"), build_errors)
    for line in format_rows(verdict.table(checks, nop=nop, allow_no_oracle=allow_no_oracle)):
        click.echo(line)
    click.echo(verdict.summary(checks, allow_no_oracle=allow_no_oracle))
    sys.exit(verdict.exit_status(checks, allow_no_oracle=allow_no_oracle))


def _run_check_batches(
    requests: Mapping[str, Mapping[str, Any]],
    settings: Any,
    all_in_one: bool,
    rootfs: Path | None,
) -> dict[str, dict[str, Any]]:
    """Submit the check's batches at once (they run side by side) and wait for their
    reports: {"oracle": report, "nop": report}."""
    from rollout_wire.errors import RolloutError
    from rollout_wire.states import Cleanup
    from rollout_wire.urls import redacted
    from rollout_worker.cli.common import console, err
    from rollout_worker.cli.stack import LocalStack
    from trainer_stub.client import RolloutClient
    from trainer_stub.display import follow

    if not requests:
        return {}
    try:
        specs = {
            name: RolloutClient.prepare(request, settings.max_batch_episodes)
            for name, request in requests.items()
        }
    except InvalidSpec as exc:
        _problems_exit(exc.problems)
    timeout = max(spec.deadline_seconds for spec in specs.values()) + 300
    with contextlib.ExitStack() as stack:
        heartbeat = None
        if all_in_one:
            env = {"ROLLOUT_ROOTFS_DIR": str(rootfs)} if rootfs is not None else {}
            local = stack.enter_context(LocalStack(collectors=1, extra_env=env))
            settings = settings.with_redis(local.redis_url)
            heartbeat = local.check_alive
            err(f"all-in-one: redis {redacted(local.redis_url)}, workers' logs in {local.dir}")
        try:
            client = stack.enter_context(contextlib.closing(RolloutClient(settings.redis_url)))
            sent = {name: client.send(spec) for name, spec in specs.items()}
            for name, submission in sent.items():
                err(f"{name}: batch {submission.batch_id}, {submission.spec.count} episodes")
            by_id = follow(client, list(sent.values()), console(True), timeout, heartbeat)
            if all_in_one:
                scheduled = [
                    s
                    for s in sent.values()
                    if by_id[s.batch_id].get("cleanup") == Cleanup.SCHEDULED
                ]
                _wait_for_cleanups(scheduled, heartbeat)
        except RolloutError as exc:
            raise click.ClickException(str(exc)) from exc
    return {name: by_id[submission.batch_id] for name, submission in sent.items()}


def _wait_for_cleanups(submissions: Sequence[Any], heartbeat: Any) -> None:
    """Before a private stack stops: let its workers delete the runs whose cleanup the report
    scheduled (bounded), as `rollout run --all-in-one` does, so no sandbox's files are left
    for the stack to remove."""
    import time

    from rollout_wire.states import Cleanup
    from rollout_worker.cli.common import CLEANUP_WAIT_SECONDS

    deadline = time.monotonic() + CLEANUP_WAIT_SECONDS
    waiting = list(submissions)
    while waiting and time.monotonic() < deadline:
        waiting = [
            s
            for s in waiting
            if s.receipt().get("cleanup") not in (Cleanup.DELETED, Cleanup.FAILED)
        ]
        if heartbeat is not None:
            heartbeat()
        time.sleep(0.2)
