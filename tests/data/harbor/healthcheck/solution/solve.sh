#!/bin/bash
# Runs after the healthcheck passed: /tmp/health-attempts holds its attempts.
set -euo pipefail
wc -l < /tmp/health-attempts > ready.txt
