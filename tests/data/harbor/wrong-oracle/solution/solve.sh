#!/bin/bash
# Wrong on purpose: exits 0 and leaves the bug in place.
echo "nothing to fix"
