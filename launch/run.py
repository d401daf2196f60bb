"""Entry point: python launch/run.py --config=configs/demo.py[:variant] --config.learner.lr=1e-3 [--dry_run]

Parses the config, finalizes it (validation names the bad key), writes the run directory and
starts the configured runtime. Logging and environment are configured here and nowhere else.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:variant].",
                                          lock_config=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate the config, print it as JSON and exit (starts nothing).")


def main(argv):
    del argv
    level = os.environ.get("LAMINAR_LOG", "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(level.lower())  # orbax logs every checkpoint at INFO otherwise
    if _CONFIG.value is None:
        print("usage: python launch/run.py --config=configs/<file>.py[:variant] [--config.<section>.<key>=<value> ...]\n"
              "  e.g. python launch/run.py --config=configs/demo.py   (configs/ holds demo.py, gpu_single.py, "
              "gpu_pod.py)", file=sys.stderr)
        return 2
    from laminar_jax.compile_cache import enable_compilation_cache
    from laminar_jax.config import ConfigError, finalize
    from laminar_jax.runtime import run

    try:
        cfg = finalize(_CONFIG.value)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if _DRY_RUN.value:
        from laminar_jax.configlib import to_json

        print(to_json(cfg))
        return 0
    enable_compilation_cache(cfg.runtime.compilation_cache_dir)  # before anything compiles
    summary = run(cfg)  # an interrupted run prints how to resume it
    # Ctrl-C is a user's interruption (exit 130, as shells report it); SIGTERM is a scheduler's
    # clean, resumable stop (exit 0).
    return 130 if summary.get("interrupted_by") == "SIGINT" else 0


if __name__ == "__main__":
    from laminar_jax.cli import run_app

    run_app(main, __doc__)
