#!/bin/bash
# The oracle's fix; runs from the workspace.
set -euo pipefail
cat > calc.py <<'PY'
def add(a, b):
    return a + b
PY
