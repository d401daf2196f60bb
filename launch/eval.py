"""Entry point: python launch/eval.py --config=configs/demo.py --checkpoint=<run_dir or HF dir> [--out=eval.jsonl]

Evaluates a policy on its own: the config's held-out prompts (data.val_files, or data.val_size for
the synthetic task), one greedy response and runtime.eval_samples sampled ones per prompt, scored by
the config's rewards: greedy accuracy, pass@k, mean response length and truncation rate, per
data_source and overall. The checkpoint is a run directory (the newest version of its weight store;
--version picks another) or a Hugging Face directory. Prints one JSON line and appends it to
<checkpoint>/eval.jsonl (or --out).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file[:variant].",
                                          lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run directory or a Hugging Face directory.")
_OUT = flags.DEFINE_string("out", None, "JSONL file the record is appended to (default <checkpoint>/eval.jsonl).")
_VERSION = flags.DEFINE_integer("version", None, "Weight version of a run directory (default: the newest).")


def main(argv):
    del argv
    from laminar_jax.cli import configure_logging, finalize_flag
    from laminar_jax.data.config import GENERATED_HINT

    configure_logging()
    usage = ("usage: python launch/eval.py --config=configs/<file>.py[:variant] --checkpoint=<run_dir or HF dir> "
             "[--out=<file.jsonl>] [--version=N]")
    cfg = finalize_flag(_CONFIG.value if _CHECKPOINT.value else None, usage)
    if cfg is None:
        return 2
    if not cfg.data.has_val():
        print("launch/eval.py needs held-out prompts: set --config.data.val_files=<file or glob> (or "
              f"--config.data.val_size=N with {GENERATED_HINT})", file=sys.stderr)
        return 2
    from laminar_jax.eval.offline import checkpoint_kind, evaluate_checkpoint

    try:
        checkpoint_kind(_CHECKPOINT.value)
    except (FileNotFoundError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    record = evaluate_checkpoint(cfg, _CHECKPOINT.value, _VERSION.value)
    out = _OUT.value or os.path.join(_CHECKPOINT.value, "eval.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    from laminar_jax.cli import run_app

    run_app(main, __doc__)
