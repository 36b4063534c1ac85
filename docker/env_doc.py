"""Regenerate the settings table of docker/README.md from the code and the compose file.

    python3 docker/env_doc.py           rewrite the table between its markers
    python3 docker/env_doc.py --check   exit 1 when the table is stale (the tests run this)

Rows come from rollout_worker.settings.SETTINGS_DOC (what each variable means) and from the
compose file's x-rollout-env anchor (what the stack sets), so the three cannot drift apart.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_worker.settings import SETTINGS_DOC  # noqa: E402

README = ROOT / "docker" / "README.md"
COMPOSE = ROOT / "docker-compose.yml"
START, END = "<!-- settings:start -->", "<!-- settings:end -->"
PASSTHROUGH = re.compile(r"^\$\{(\w+):-\}$")


def stack_value(name: str, value: str | None) -> str:
    if value is None:
        return "not set by the stack"
    match = PASSTHROUGH.match(value)
    if match and match.group(1) == name:
        return "from your shell or `.env` (empty: default)"
    return f"`{value}` (fixed)"


def settings_table(doc: dict[str, str], anchor: dict[str, str]) -> str:
    lines = ["| variable | meaning | in the stack |", "| --- | --- | --- |"]
    for name, meaning in doc.items():
        text = meaning.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| `{name}` | {text} | {stack_value(name, anchor.get(name))} |")
    return "\n".join(lines)


def rendered(readme: str, table: str) -> str:
    head, _, rest = readme.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    anchor = yaml.safe_load(COMPOSE.read_text())["x-rollout-env"]
    readme = README.read_text()
    if START not in readme or END not in readme:
        print(f"{README}: markers {START} / {END} are missing", file=sys.stderr)
        return 1
    wanted = rendered(readme, settings_table(SETTINGS_DOC, anchor))
    if "--check" in argv:
        if wanted != readme:
            print(f"{README} is stale: run python3 docker/env_doc.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
