"""The entry-point wrapper every `launch/*.py` shares (absl flags + ml_collections config files)."""

from __future__ import annotations

import logging
import os
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


def configure_logging() -> None:
    """Logging is configured here, by the entry points, and nowhere else (LAMINAR_LOG sets the level)."""
    from absl import logging as absl_logging

    level = os.environ.get("LAMINAR_LOG", "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(level.lower())  # orbax logs every checkpoint at INFO otherwise


def finalize_flag(value, usage: str):
    """The --config flag's value finalized, XLA's CPU threads and matrix-product precision set and the
    compilation cache enabled; None (after printing `usage` or the config error naming the key) when
    there is no usable config."""
    from laminar_jax.config import ConfigError, finalize
    from laminar_jax.process_settings import apply_process_settings

    if value is None:
        print(usage, file=sys.stderr)
        return None
    try:
        cfg = finalize(value)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return None
    apply_process_settings(cfg)  # before JAX starts, compiles or traces anything
    return cfg
