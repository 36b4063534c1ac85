"""Exit 0 when calc.add (from the working directory) adds."""

import os
import sys

sys.path.insert(0, os.getcwd())  # the workspace, not /tests

from calc import add

cases = [((1, 2), 3), ((-4, 4), 0), ((10, 5), 15)]
failed = [(args, want, add(*args)) for args, want in cases if add(*args) != want]
for args, want, got in failed:
    print(f"add{args} = {got}, want {want}")
sys.exit(1 if failed else 0)
