"""The entry-point wrapper every `launch/*.py` shares (absl flags + ml_collections config files)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Optional, Sequence


def run_app(main: Callable[[list], int], doc: str) -> None:
    """Run `main` under absl. `--help` prints `doc` and the flags and exits 0 (absl's own exits 1);
    an unknown `--config.<section>.<key>`, or a `--config` file that is missing or not a .py file,
    is a config error naming the key or path (exit 2), before ml_collections stops on it with a bare
    traceback or an unreadable error."""
    from absl import app, flags

    from laminar_jax.config import unknown_override

    if {"-h", "--help", "--helpshort"} & set(sys.argv[1:]):
        print(doc.strip() + "\n\nflags:\n" + flags.FLAGS.main_module_help().split("\n", 1)[-1])
        sys.exit(0)
    bad = unknown_override(sys.argv[1:])
    value = config_arg(sys.argv[1:])
    bad = bad or (config_file_error(value) if value is not None else None)
    if bad:
        print(f"config error: {bad}", file=sys.stderr)
        sys.exit(2)
    app.run(lambda argv: sys.exit(main(argv)))


def config_arg(argv: Sequence[str]) -> Optional[str]:
    """The value of `--config=X` / `--config X` in `argv` (None when absent)."""
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def config_file_error(value: str, variant: bool = True) -> Optional[str]:
    """One line saying why `--config=value` (`file.py[:variant]` when `variant`) cannot be a config
    file (missing, a directory, not .py); None when it can."""
    path = value.partition(":")[0] if variant else value
    if not path:
        return "--config: no file named"
    if not os.path.exists(path):
        return f"--config: {path}: no such file"
    if os.path.isdir(path):
        return f"--config: {path}: is a directory, not a .py config file"
    if not path.endswith(".py"):
        return f"--config: {path}: not a .py config file (a python file whose get_config() returns the config)"
    return None


def load_config_module(value: str, variant: bool = True):
    """The module of config file `value` (checked by `config_file_error`; it must define
    get_config); a ConfigError naming the path otherwise."""
    import importlib.util

    from laminar_jax.configlib import ConfigError

    err = config_file_error(value, variant)
    path = value.partition(":")[0] if variant else value
    if err is None:
        spec = importlib.util.spec_from_file_location("laminar_config_file", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if callable(getattr(mod, "get_config", None)):
            return mod
        err = f"--config: {path}: defines no get_config()"
    raise ConfigError(err)


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
