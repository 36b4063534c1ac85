#!/bin/bash
# The oracle's fix (all four checks pass: reward 1.0); runs from the workspace.
set -euo pipefail
python3 - <<'PY'
from pathlib import Path

path = Path("text_tools.py")
text = path.read_text()
text = text.replace('"".join(word[0] for word', '"".join(word[0].upper() for word')
text = text.replace('if ch in "aeiou"', 'if ch.lower() in "aeiou"')
path.write_text(text)
PY
