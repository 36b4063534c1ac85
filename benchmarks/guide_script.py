"""The guide's own script, rebuilt at run time from the guide's text (never stored here).

The guide (shared/seed/rl-batch-demo-guide.txt in the folder that holds this clone, section 十)
prints its script as one line: the web page it was saved from dropped every line break,
collapsed each line's indentation to one space (so a line that was not indented follows the
previous one directly), doubled every backslash and turned `--` into an en dash. This module
undoes that:

1. It takes the script's line (from `#!/usr/bin/env python3` on) and undoes the backslashes and
   the dashes (an en dash, U+2013, is `--` inside a string literal and a minus outside).
2. It splits each code unit into statements with Python's own parser as the judge. A statement
   may end, outside strings and brackets, at a space (the next line was indented) or where the
   next one is glued on (it was not): after a closing bracket or quote, or inside a run of
   letters that is two words (a statement keyword, or a name the unit uses on its own, glued to
   a name: `sysimport`, `timep`). It always ends after a header's colon, before a comment (which
   ends at its first full stop) and before `(` that follows an operand after a space. Each
   statement is the longest that compiles and lets the rest split too (with backtracking).
3. It indents: after a `header:` one level deeper; after a glued boundary column 0; `else:`,
   `elif`, `except`, `finally` align with their opening statement; after return, raise, break
   or continue one level out; otherwise the same level. The few places where the text says
   nothing and only meaning decides are listed in LAYOUT and BREAKS below (the first words of
   a statement; its level, or that a statement starts there), and every one must be used.
4. A triple-quoted string whose text starts with `import ` is itself a program (the episode, and
   the test file the episode writes): it is rebuilt the same way, at column 0.

The result must compile, define `main`, `collect` and `percentile`, and its episode program
must compile too; otherwise `GuideScriptError` says where it went wrong.

    python -m benchmarks.guide_script [--out FILE]     print (or write) the rebuilt script
"""

from __future__ import annotations

import argparse
import ast
import keyword
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUIDE_NAME = Path("shared") / "seed" / "rl-batch-demo-guide.txt"
# Where the guide may be, first match wins: ROLLOUT_GUIDE names it; else the workplace's
# shared folder beside the clone (<repo>/../shared/seed/) or beside any folder above it (a
# clone made deeper, e.g. a CI checkout under the workplace); else the workplace's own
# shared folder (/work/shared), for a clone made outside the workplace on the same machine.
GUIDE_PLACES = (
    *([Path(os.environ["ROLLOUT_GUIDE"])] if os.environ.get("ROLLOUT_GUIDE") else []),
    *(folder / GUIDE_NAME for folder in REPO.parents),
    Path("/work") / GUIDE_NAME,
)
GUIDE = next((place for place in GUIDE_PLACES if place.is_file()), GUIDE_PLACES[0])
START = "#!/usr/bin/env python3"

# Where the layout leaves the level open and only meaning decides: (first words of the
# statement, absolute indentation level). Levels count from 0 (column 0).
LAYOUT: tuple[tuple[str, int], ...] = (
    # the episode's test file: the second and third test methods
    ("def test_boundary(", 1),
    ("def test_above(", 1),
    # collect(): after the loop over Pods
    ("startup = ", 1),
    # main(): after the argument check, the cleanup branch's steps, the wait, the log reader
    ("if args.action == 'cleanup':", 1),
    ("def kubectl(", 1),
    ("if json.loads(raw_job)", 3),
    ("kubectl('delete', 'namespace'", 2),
    ("print('Deleted test namespace:'", 2),
    ("observed = ", 1),
    ("(output/(name+'.log'))", 2),
    ("if conditions.get('Complete')!=", 1),
)
# Where a statement starts although the previous one could swallow it (`...; return` then a
# new line, read as `return <it>`): its first words.
BREAKS: tuple[str, ...] = ("output.mkdir(",)

OPENERS = ("else", "elif", "except", "finally")
OPENED_BY = {
    "else": ("if", "elif", "for", "while", "try", "except"),
    "elif": ("if", "elif"),
    "except": ("try", "except"),
    "finally": ("try", "except", "else"),
}


class GuideScriptError(RuntimeError):
    pass


def script_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith(START):
            return line.rstrip()
    raise GuideScriptError(f"no line starting with {START!r} in the guide")


# -- lexing ------------------------------------------------------------------------------------
_STRING_START = re.compile(r"""(?i)(?:[rbuf]{0,2})('''|\"\"\"|'|")""")


@dataclass(frozen=True)
class Literal:
    start: int  # index of the prefix / opening quote
    end: int  # index after the closing quote
    quote: str
    body_start: int
    body_end: int


def _literal_at(code: str, i: int) -> Literal | None:
    """The string literal starting at i (with its r/b/f prefix), or None."""
    if i > 0 and (code[i - 1].isalnum() or code[i - 1] == "_") and code[i] not in "'\"":
        return None
    match = _STRING_START.match(code, i)
    if not match:
        return None
    quote = match.group(1)
    body_start = match.end()
    raw = "r" in code[i : match.start(1)].lower()
    j = body_start
    while j < len(code):
        if not raw and code[j] == "\\":
            j += 2
            continue
        if code.startswith(quote, j):
            return Literal(i, j + len(quote), quote, body_start, j)
        j += 1
    raise GuideScriptError(f"unterminated string literal at {i}: {code[i : i + 40]!r}")


def _comment_end(code: str, i: int) -> int:
    """A comment (at i, outside strings) ends at its first full stop."""
    stop = code.find(".", i)
    if stop < 0:
        raise GuideScriptError(f"a comment without a full stop at {i}")
    return stop + 1


def fix_dashes(code: str) -> str:
    """En dashes: `--` inside string literals, `-` in code."""
    out, i = [], 0
    while i < len(code):
        if code[i] == "#":
            end = _comment_end(code, i)
            out.append(code[i:end])
            i = end
            continue
        lit = _literal_at(code, i) if code[i] in "'\"rbufRBUF" else None
        if lit is not None:
            out.append(code[lit.start : lit.end].replace("\u2013", "--"))
            i = lit.end
            continue
        out.append("-" if code[i] == "\u2013" else code[i])
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class Scan:
    """Where statements may end, at bracket depth 0 outside strings and comments.

    A boundary is a position where the next statement starts; `spaced` ones stand for a space
    (newline + indentation: the next line was indented), the others for nothing (column 0).
    `hard` boundaries end a statement for sure (after a header's colon, after a comment, inside
    a run of letters that is two words glued together); the others may be inside one.
    """

    soft: set[int]
    hard: set[int]
    spaced: set[int]


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DELIMITED = re.compile(r"(?<![A-Za-z0-9_.])[A-Za-z_][A-Za-z0-9_]*(?![A-Za-z0-9_])")
STATEMENT_KEYWORDS = ("import", "from", "class", "def", "if", "for", "while", "with", "try")


def _outside_strings(code: str) -> str:
    """The code with string literals and comments blanked out."""
    out, i = [], 0
    while i < len(code):
        if code[i] == "#":
            end = _comment_end(code, i)
            out.append(" " * (end - i))
            i = end
            continue
        lit = _literal_at(code, i) if code[i] in "'\"rbufRBUF" else None
        if lit is None:
            out.append(code[i])
            i += 1
            continue
        out.append(" " * (lit.end - lit.start))
        i = lit.end
    return "".join(out)


@dataclass(frozen=True)
class Words:
    counts: dict[str, int]  # how often each name stands on its own (not after a dot)
    bound: set[str]  # names a statement binds: def, class, `name = ...`


def words(code: str) -> Words:
    bare = _outside_strings(code)
    counts: dict[str, int] = {}
    for match in _DELIMITED.finditer(bare):
        counts[match.group(0)] = counts.get(match.group(0), 0) + 1
    bound = set(re.findall(r"\b(?:def|class) ([A-Za-z_]\w*)", bare))
    bound |= set(re.findall(r"([A-Za-z_]\w*) = ", bare))
    return Words(counts, bound)


def _glue_inside(run: str, dotted: bool, known: Words) -> int | None:
    """Where a run of letters is two words glued together (a statement ending in the first,
    the next line starting at column 0 with the second), else None.

    Only a run seen at most once on its own is split (a real name recurs); the second word is
    a statement keyword, or a name the unit binds (def, class, assignment) after a first word
    that is a name too (or an attribute), or a name used elsewhere after one."""
    if keyword.iskeyword(run) or known.counts.get(run, 0) > 1:
        return None
    for cut in range(2, len(run)):
        head, tail = run[:cut], run[cut:]
        if head.endswith("_"):  # write_text, parse_args: one name
            continue
        if tail in STATEMENT_KEYWORDS:
            return cut
        if tail in known.bound and (known.counts.get(head, 0) >= 1 or dotted):
            return cut
        if not dotted and known.counts.get(head, 0) >= 1 and known.counts.get(tail, 0) >= 1:
            return cut
    return None


def _is_name_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def _starts_word(code: str, i: int) -> bool:
    return i < len(code) and (code[i].isalpha() or code[i] in "_#")


def _call_gap(code: str, i: int) -> bool:
    """A space between an operand and `(` (`x (y)`): nobody writes a call so, it is a new line."""
    if not code.startswith("(", i + 1) or i == 0:
        return False
    before = code[i - 1]
    if before in ")]}'\"":
        return True
    word = re.search(r"[A-Za-z0-9_]+$", code[:i])
    return word is not None and not keyword.iskeyword(word.group(0))


def scan(code: str, breaks: tuple[str, ...] = ()) -> Scan:
    known = words(code)
    soft: set[int] = set()
    hard: set[int] = set()
    spaced: set[int] = set()
    depth, i = 0, 0
    while i < len(code):
        c = code[i]
        if c == "#" and depth == 0:
            hard.add(i)  # a comment is a line of its own
            i = _comment_end(code, i)
            (spaced if code.startswith(" ", i) else set()).add(i + 1)
            hard.add(i + 1 if code.startswith(" ", i) else i)
            continue
        lit = _literal_at(code, i) if c in "'\"rbufRBUF" else None
        if lit is not None:
            i = lit.end
            if depth == 0 and _starts_word(code, i):
                soft.add(i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if depth == 0:
            if c == " ":
                spaced.add(i + 1)
                header = i > 0 and code[i - 1] == ":"
                (hard if header or _call_gap(code, i) else soft).add(i + 1)
            elif c in ")]}" and _starts_word(code, i + 1):
                soft.add(i + 1)
            elif _starts_word(code, i) and (i == 0 or not _is_name_char(code[i - 1])):
                run = _WORD.match(code, i)
                assert run is not None
                cut = _glue_inside(run.group(0), i > 0 and code[i - 1] == ".", known)
                if cut is not None:
                    hard.add(i + cut)
                i = run.end()
                continue
        i += 1
    for start in sorted(spaced):
        if any(code.startswith(b, start) for b in breaks):
            hard.add(start)
    return Scan(soft, hard, spaced)


# -- splitting ---------------------------------------------------------------------------------
def _compiles(statement: str) -> bool:
    text = statement.strip()
    if not text:
        return False
    if text.startswith("#"):
        return True
    first = text.split()[0].rstrip(":")
    if text.endswith(":"):
        if first in ("except", "finally"):
            body = "try:\n pass\n" + text + "\n pass\n"
        elif first in ("else", "elif"):
            body = "if 1:\n pass\n" + text + "\n pass\n"
        elif first == "try":
            body = text + "\n pass\nfinally:\n pass\n"
        else:
            body = text + "\n pass\n"
    elif first == "return":
        body = "def _f():\n " + text + "\n"
    elif first in ("break", "continue"):
        body = "while 1:\n " + text + "\n"
    else:
        body = text + "\n"
    try:
        ast.parse(body)
    except SyntaxError:
        return False
    return True


def _ends_flow(text: str) -> bool:
    """Does this simple statement (or the last of `a; b`) end with return/raise/break/continue?"""
    if text.endswith(":") or text.startswith("#"):
        return False
    try:
        tree = ast.parse("def _f():\n while 1:\n  " + text + "\n")
    except SyntaxError:
        return False
    loop = tree.body[0].body[0]  # type: ignore[attr-defined]
    return isinstance(loop.body[-1], ast.Return | ast.Raise | ast.Break | ast.Continue)


@dataclass(frozen=True)
class Statement:
    text: str
    glued: bool  # started directly after the previous one (column 0)


def split(code: str, breaks: tuple[str, ...] = ()) -> list[Statement]:
    """Statements, each the longest that compiles and lets the rest split too."""
    where = scan(code, breaks)
    bounds = sorted(where.soft | where.hard | {len(code)})
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    failed: set[int] = set()

    def from_(start: int) -> list[Statement] | None:
        if start >= len(code):
            return []
        if start in failed:
            return None
        ends = []
        for end in bounds:
            if end <= start:
                continue
            ends.append(end)
            if end in where.hard:
                break
        for end in reversed(ends):
            stop = end - 1 if end in where.spaced else end
            text = code[start:stop]
            if not _compiles(text):
                continue
            rest = from_(end)
            if rest is not None:
                return [Statement(text.strip(), start == 0 or start not in where.spaced), *rest]
        failed.add(start)
        return None

    result = from_(0)
    if result is None:
        raise GuideScriptError("could not split the code into statements")
    return result


# -- indenting ---------------------------------------------------------------------------------
def indent(statements: list[Statement], layout: dict[str, int], used: set[str]) -> list[str]:
    lines: list[str] = []
    stack: list[tuple[int, str]] = []  # open compound statements: (level, first word)
    level = 0
    prev: Statement | None = None
    for st in statements:
        first = re.split(r"[\s:(]", st.text, maxsplit=1)[0]
        hint = next((k for k in layout if st.text.startswith(k)), None)
        if prev is None or st.glued:
            level = 0
        elif prev.text.endswith(":") and not prev.text.startswith("#"):
            level = level + 1
        elif first in OPENERS:
            match = next((lv for lv, w in reversed(stack) if w in OPENED_BY[first]), None)
            if match is None:
                raise GuideScriptError(f"{st.text[:40]!r} has no opening statement")
            level = match
        elif _ends_flow(prev.text):
            level = max(1, level - 1)
        if hint is not None:
            level = layout[hint]
            used.add(hint)
        if st.glued and level != 0:
            raise GuideScriptError(f"{st.text[:40]!r}: glued but indented")
        stack = [(lv, w) for lv, w in stack if lv < level]
        if st.text.endswith(":") and not st.text.startswith("#"):
            stack.append((level, first))
        lines.append("    " * level + st.text)
        prev = st
    return lines


# -- programs inside strings ---------------------------------------------------------------
def rebuild(code: str, layout: dict[str, int], used: set[str]) -> str:
    """Rebuild one code unit, its embedded programs first."""
    out, i = [], 0
    while i < len(code):
        if code[i] == "#":
            end = _comment_end(code, i)
            out.append(code[i:end])
            i = end
            continue
        lit = _literal_at(code, i) if code[i] in "'\"rbufRBUF" else None
        if lit is None:
            out.append(code[i])
            i += 1
            continue
        body = code[lit.body_start : lit.body_end]
        if len(lit.quote) == 3 and body.startswith("import "):
            inner = rebuild(body, layout, used)
            try:
                ast.parse(inner)
            except SyntaxError as exc:
                raise GuideScriptError(f"an embedded program does not compile: {exc}") from exc
            out.append(code[lit.start : lit.body_start] + inner + "\n" + lit.quote)
        else:
            out.append(code[lit.start : lit.end])
        i = lit.end
    flat = "".join(out)
    # Literals now hold newlines; split and indent what is outside them.
    return "\n".join(indent(split(flat, BREAKS), layout, used))


def guide_script(text: str | None = None) -> str:
    """The guide's script as a runnable program."""
    if text is None:
        if not GUIDE.is_file():
            places = ", ".join(str(place) for place in GUIDE_PLACES)
            raise GuideScriptError(f"the guide is in none of: {places} (or set ROLLOUT_GUIDE)")
        text = GUIDE.read_text()
    raw = script_line(text)
    code = fix_dashes(raw[len(START) :].replace("\\\\", "\\"))
    layout = dict(LAYOUT)
    used: set[str] = set()
    source = START + "\n" + rebuild(code, layout, used) + "\n"
    unused = set(layout) - used
    starts = {line.strip().split(" ")[0] for line in source.splitlines()}
    unused |= {b for b in BREAKS if not any(s.startswith(b) for s in starts)}
    if unused:
        raise GuideScriptError(f"layout hints not used (the guide changed?): {sorted(unused)}")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise GuideScriptError(f"the rebuilt script does not compile: {exc}") from exc
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    if not {"main", "collect", "percentile"} <= names:
        raise GuideScriptError(f"functions missing from the rebuilt script: {sorted(names)}")
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    source = guide_script()
    if args.out:
        args.out.write_text(source)
    else:
        sys.stdout.write(source)


if __name__ == "__main__":
    main()
