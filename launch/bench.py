"""Benchmarks: python launch/bench.py <learner|engine|relay|e2e|faults|sim|peers> [--quick] [options]

Each prints a table and, as its last line, one JSON object with the figures.
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAMES = ("learner", "engine", "relay", "e2e", "faults", "sim", "peers")


def main(argv):
    if not argv or argv[0] not in NAMES:
        print(f"usage: bench.py <{'|'.join(NAMES)}> [--quick] [options]", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"laminar_jax.benchmarks.{argv[0]}")
    mod.main(argv[1:])  # prints its table, then its JSON line last
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
