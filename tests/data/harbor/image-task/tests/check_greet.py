"""Exit 0 when /app/greet.py greets as asked."""

import sys

sys.path.insert(0, "/app")

from greet import greeting

got = greeting("Ada")
print(f"greeting('Ada') = {got!r}")
sys.exit(0 if got == "Hello, Ada!" else 1)
