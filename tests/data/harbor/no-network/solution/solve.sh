#!/bin/bash
set -euo pipefail
python3 -B probe.py > network.txt
