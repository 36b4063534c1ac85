#!/bin/bash
# Needs about 430 MB: more than the default limit, within the task's memory_mb.
set -euo pipefail
python3 -c 'data = b"x" * (400 * 2**20); print(len(data))' > size.txt
