#!/bin/bash
# Runs from the task's workdir.
set -euo pipefail
cp data.txt out.txt
