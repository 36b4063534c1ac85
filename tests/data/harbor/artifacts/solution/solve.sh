#!/bin/bash
set -euo pipefail
mkdir -p /logs/agent
python3 -c 'print(sum(int(line) for line in open("numbers.txt")))' > report.txt
echo "summed numbers.txt with python3" > /logs/agent/notes.txt
