"""The docs keep their promises: every command a page shows is run by a test or says why not,
the cheap ones are run here as shown, and every relative link lands on a file (and heading).

A command block (a fence of `sh`, `bash`, `console` or `shell`) carries a mark on the line
before it:

    <!-- tested: tests/path.py::test_name [more ids] -->
    <!-- not run here: the reason -->

A `tested:` mark naming this file's command tests is run by them, block by block, as shown.
`mkdocs build --strict` (hack/test.sh) checks the site itself.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGUAGES = {"sh", "bash", "console", "shell"}
MARK = re.compile(r"^<!--\s*(tested|not run here):\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
CHEAP = f"{THIS}::test_the_cheap_commands_shown_run_as_shown"
FIRST_BATCH = f"{THIS}::test_the_first_batch_runs_as_shown"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    mark: tuple[str, str] | None  # (kind, argument)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening.group(2)
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)),
            len(lines),
        )
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        mark = MARK.match(before)
        body = "\n".join(line.removeprefix(opening.group(1)) for line in lines[i + 1 : end])
        found.append(Block(page, i + 1, opening.group(3), body, mark.groups() if mark else None))
        i = end + 1
    return found


def command_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page) if b.language in COMMAND_LANGUAGES]


def blocks_run_by(test_id: str) -> list[Block]:
    """The command blocks whose mark names `test_id`, each text once (pages repeat examples)."""
    unique: dict[str, Block] = {}
    for block in command_blocks():
        if block.mark and block.mark[0] == "tested" and test_id in block.mark[1].split():
            unique.setdefault(block.text, block)
    return list(unique.values())


def start_block(block: Block) -> subprocess.Popen[str]:
    # As a user runs it from the clone: the venv's commands first on PATH; background jobs (a
    # policy server) are stopped when the block ends.
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + block.text
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a block cut short takes its background jobs with it
    )


def on_free_ports(text: str, ports: set[str]) -> str:
    for port in sorted(ports):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = str(probe.getsockname()[1])
        text = re.sub(rf"(--port |:){port}\b", rf"\g<1>{free}", text)
    return text


def run_blocks(blocks: list[Block], timeout: float) -> list[tuple[Block, int, str]]:
    """Each block's exit status and output; the blocks run side by side (each its own stack)."""
    started = [(block, start_block(block)) for block in blocks]
    done = []
    for block, proc in started:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        done.append((block, proc.returncode, out + err))
    return done


def test_the_pages_are_found():
    names = {page.name for page in PAGES}
    assert {"README.md", "index.md", "getting-started.md", "api.md"} <= names, names


def test_the_parser_reads_marks_fences_and_indented_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not run here: it needs a cluster -->\n```sh\nkubectl get pods\n```\n\n"
        "text\n\n```bash\nrollout --help\n```\n\n"
        "- item\n\n    <!-- tested: tests/unit/test_docs.py::test_x -->\n"
        "    ```sh\n    ls\n    ```\n"
        "```\nno language\n```\n"
    )
    found = [(b.line, b.language, b.text, b.mark) for b in fenced_blocks(page)]
    assert found == [
        (2, "sh", "kubectl get pods", ("not run here", "it needs a cluster")),
        (8, "bash", "rollout --help", None),
        (15, "sh", "ls", ("tested", "tests/unit/test_docs.py::test_x")),
        (18, "", "no language", None),
    ]


def test_every_fence_names_its_language():
    # An unlabelled fence could hide a command from the marks below: diagrams say `text`.
    bare = [b.where for page in PAGES for b in fenced_blocks(page) if not b.language]
    assert bare == [], f"fences without a language: {bare}"


def test_every_command_block_is_run_by_a_test_or_says_why_not():
    unmarked = [b.where for b in command_blocks() if b.mark is None]
    assert unmarked == [], (
        "command blocks without <!-- tested: tests/...::test_x --> or "
        f"<!-- not run here: reason -->: {unmarked}"
    )


def test_every_not_run_mark_gives_its_reason():
    vague = [
        b.where
        for b in command_blocks()
        if b.mark and b.mark[0] == "not run here" and len(b.mark[1]) < 20
    ]
    assert vague == [], f"'not run here' needs a reason a reader can check: {vague}"


def test_every_tested_mark_names_a_test_that_exists():
    missing = []
    for block in command_blocks():
        if not block.mark or block.mark[0] != "tested":
            continue
        ids = block.mark[1].split()
        if not ids:
            missing.append(f"{block.where}: no test named")
        for test_id in ids:
            path, _, name = test_id.partition("::")
            file = ROOT / path
            parts = name.split("::")
            source = file.read_text() if file.is_file() and path.startswith("tests/") else ""
            found = bool(parts[0]) and all(
                re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(p)}\b", source, re.M)
                for p in parts
            )
            if not found:
                missing.append(f"{block.where}: {test_id}")
    assert missing == [], f"marks naming no existing test: {missing}"


# ---- links ---------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code (links there are not links)."""
    text = page.read_text()
    for block in fenced_blocks(page):
        text = text.replace(block.text, "")
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    # Python-Markdown's toc slugify (what mkdocs uses); GitHub's agrees on these headings.
    text = re.sub(r"[`*_]", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for line in prose(page).splitlines() if (m := HEADING.match(line))}


def test_every_relative_link_resolves_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == [], broken


def test_the_link_checker_sees_links_and_headings():
    assert slug("Deploy to a cluster: the Helm chart") == "deploy-to-a-cluster-the-helm-chart"
    assert slug("Redis: durability and high availability") == (
        "redis-durability-and-high-availability"
    )
    readme_links = LINK.findall(prose(ROOT / "README.md"))
    assert "docs/getting-started.md" in readme_links, readme_links


# ---- the commands run here -----------------------------------------------------------------


def test_the_cheap_commands_shown_run_as_shown():
    blocks = blocks_run_by(CHEAP)
    assert len(blocks) >= 2, "the pages lost their cheap commands"
    for block, status, output in run_blocks(blocks, timeout=120):
        assert status == 0, f"{block.where}:\n{block.text}\n{output}"
        assert output.strip(), f"{block.where} printed nothing"


@pytest.mark.redis
@pytest.mark.workers
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_first_batch_runs_as_shown():
    # Each block starts its own Redis and workers (--all-in-one) and a policy server if shown.
    blocks = blocks_run_by(FIRST_BATCH)
    assert blocks, "the pages lost their first batch"
    # The page's policy server listens on a fixed port, which another process may hold here:
    # the blocks run as shown but for that number, a free port's.
    shown = {p for block in blocks for p in re.findall(r"--port (\d+)", block.text)}
    blocks = [replace(b, text=on_free_ports(b.text, shown)) for b in blocks]
    for block, status, output in run_blocks(blocks, timeout=300):
        assert status == 0, f"{block.where}:\n{block.text}\n{output}"
        assert "succeeded" in output, f"{block.where}:\n{output}"
