#!/bin/bash
# The oracle sees [environment.env] then [solution.env] (solution's BOTH wins), never
# [verifier.env].
set -euo pipefail
{
    echo "SHOWN=${SHOWN-unset}"
    echo "JUDGE=${JUDGE-unset}"
    echo "HINT=${HINT-unset}"
    echo "BOTH=${BOTH-unset}"
} > seen.txt
