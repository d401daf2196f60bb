"""Entry point: python launch/run.py --config=configs/demo.py[:variant] --config.learner.lr=1e-3 [--dry_run]

Parses the config, finalizes it (validation names the bad key), writes the run directory and
starts the configured runtime. Logging and environment are configured here and nowhere else.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:variant].",
                                          lock_config=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate the config, print it as JSON and exit (starts nothing).")


def main(argv):
    del argv
    from laminar_jax.cli import configure_logging, finalize_flag

    configure_logging()
    cfg = finalize_flag(_CONFIG.value, "usage: python launch/run.py --config=configs/<file>.py[:variant] "
                        "[--config.<section>.<key>=<value> ...]\n  e.g. python launch/run.py --config=configs/demo.py"
                        "   (configs/ holds demo.py, gpu_single.py, gpu_pod.py)")
    if cfg is None:
        return 2
    if _DRY_RUN.value:
        from laminar_jax.configlib import to_json

        print(to_json(cfg))
        return 0
    from laminar_jax.runtime import run

    summary = run(cfg)  # an interrupted run prints how to resume it
    # Ctrl-C is a user's interruption (exit 130, as shells report it); SIGTERM is a scheduler's
    # clean, resumable stop (exit 0).
    return 130 if summary.get("interrupted_by") == "SIGINT" else 0


if __name__ == "__main__":
    from laminar_jax.cli import run_app

    run_app(main, __doc__)
