"""What a Dockerfile needs from elsewhere (its base images), and what to tell the user when
docker could not get one: which image, and the ways to provide it (pure, tested without Docker).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from rollout_worker.cli.image_commands import last_line


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
