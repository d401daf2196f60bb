"""Entry point: python launch/sft.py --config=configs/demo.py --out=<hf_dir> [--steps=N] [--overwrite] [--config.x=y]

Supervised warm-start alone, then export: the config's model is trained with cross-entropy on
(prompt, response) pairs (data.source='synthetic_skew', or data.source='file' with a jsonl /
parquet whose rows have 'prompt' and 'response') for runtime.sft_warmup_steps steps (or --steps)
at runtime.sft_lr, and written to --out as a Hugging Face directory (weights, config.json,
generation_config.json, tokenizer). --out is checked before training: a file, a directory that is
not writable, or a non-empty directory (unless --overwrite, which replaces its contents once the
export is written) is an error (exit 2). Prints progress on stderr and one JSON summary line on stdout.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:variant].",
                                          lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Output Hugging Face directory.")
_STEPS = flags.DEFINE_integer("steps", None, "SFT steps (default: runtime.sft_warmup_steps).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the contents of a non-empty --out directory.")


def main(argv):
    del argv
    from laminar_jax.cli import configure_logging, finalize_flag

    configure_logging()
    usage = "usage: python launch/sft.py --config=configs/<file>.py[:variant] --out=<hf_dir> [--steps=N] [--overwrite]"
    cfg = finalize_flag(_CONFIG.value if _OUT.value else None, usage)
    if cfg is None:
        return 2
    from laminar_jax.configlib import ConfigError
    from laminar_jax.learner.sft import OutDirError, run_sft

    try:
        summary = run_sft(cfg, os.path.abspath(_OUT.value), _STEPS.value, log=lambda m: print(m, file=sys.stderr),
                          overwrite=_OVERWRITE.value)
    except (OutDirError, ConfigError) as e:
        print(f"{'config ' if isinstance(e, ConfigError) else ''}error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from laminar_jax.cli import run_app

    run_app(main, __doc__)
