#!/bin/bash
# Edits the file by absolute path: the workspace of an image task is its WORKDIR, /app.
set -euo pipefail
cat > /app/greet.py <<'PY'
def greeting(name):
    return f"Hello, {name}!"
PY
