"""The entry-point wrapper every `launch/*.py` shares (absl flags + ml_collections config files)."""

from __future__ import annotations

import sys
from typing import Callable


def run_app(main: Callable[[list], int], doc: str) -> None:
    """Run `main` under absl. `--help` prints `doc` and the flags and exits 0 (absl's own exits 1);
    an unknown `--config.<section>.<key>` is a config error naming the key (exit 2), before
    ml_collections stops on it with a bare traceback."""
    from absl import app, flags

    from laminar_jax.config import unknown_override

    if {"-h", "--help", "--helpshort"} & set(sys.argv[1:]):
        print(doc.strip() + "\n\nflags:\n" + flags.FLAGS.main_module_help().split("\n", 1)[-1])
        sys.exit(0)
    bad = unknown_override(sys.argv[1:])
    if bad:
        print(f"config error: {bad}", file=sys.stderr)
        sys.exit(2)
    app.run(lambda argv: sys.exit(main(argv)))
