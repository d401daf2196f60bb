"""Entry point: python launch/sft.py --config=configs/demo.py --out=<hf_dir> [--steps=N] [--config.x=y ...]

Supervised warm-start alone, then export: the config's model is trained with cross-entropy on
(prompt, response) pairs (data.source='synthetic_skew', or data.source='file' with a jsonl /
parquet whose rows have 'prompt' and 'response') for runtime.sft_warmup_steps steps (or --steps)
at runtime.sft_lr, and written to --out as a Hugging Face directory (weights, config.json,
generation_config.json, tokenizer). Prints progress on stderr and one JSON summary line on stdout.
"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:variant].",
                                          lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Output Hugging Face directory.")
_STEPS = flags.DEFINE_integer("steps", None, "SFT steps (default: runtime.sft_warmup_steps).")


def main(argv):
    del argv
    level = os.environ.get("LAMINAR_LOG", "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(level.lower())
    if _CONFIG.value is None or not _OUT.value:
        print("usage: python launch/sft.py --config=configs/<file>.py[:variant] --out=<hf_dir> [--steps=N]",
              file=sys.stderr)
        return 2
    from laminar_jax.compile_cache import enable_compilation_cache
    from laminar_jax.config import ConfigError, finalize
    from laminar_jax.learner.sft import run_sft

    try:
        cfg = finalize(_CONFIG.value)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache(cfg.runtime.compilation_cache_dir)
    summary = run_sft(cfg, os.path.abspath(_OUT.value), _STEPS.value, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from laminar_jax.cli import run_app

    run_app(main, __doc__)
