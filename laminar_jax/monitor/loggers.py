"""Scalar loggers behind the monitor (runtime.loggers): TensorBoard and Weights & Biases.

Both take `add_scalar(tag, value, step)` and `close()`. TensorBoard is the default (tensorboardX;
skipped quietly if it is not installed, as before). W&B is an optional extra (`pip install -e
".[wandb]"`); asking for it without the package is an error naming runtime.loggers. W&B needs a
non-decreasing step per chart, while the warm-start's losses come after the first RL steps on an
axis of their own: each tag prefix ('train', 'eval', 'warm_start', ...) gets its own step metric.
"""

from __future__ import annotations

import os
from typing import Optional

from laminar_jax.configlib import ConfigError


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch whenever it is installed, only to recognise torch tensors; this
    logger writes Python floats, and importing torch cost ~1.7 s of every run's start-up where it is
    installed (the test and peers extras). A None entry in sys.modules makes that import fail as if
    torch were absent; it is removed again at once, so later imports of torch work as usual.
    """
    import sys

    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardLogger:
    def __init__(self, run_dir: str):
        self.writer = _summary_writer_class()(os.path.join(run_dir, "tb"))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One W&B run per laminar run (its name: the run directory's), files under <run_dir>/wandb."""

    def __init__(self, run_dir: str, project: str, config: Optional[dict] = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("runtime.loggers includes 'wandb' but the wandb package is not installed: "
                              "pip install -e \".[wandb]\" (or drop 'wandb' from runtime.loggers)") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir,
                              config=config, reinit="finish_previous")
        self._axes: set[str] = set()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        prefix = tag.split("/", 1)[0]
        axis = f"{prefix}/step"
        if prefix not in self._axes:
            self.run.define_metric(axis)
            self.run.define_metric(f"{prefix}/*", step_metric=axis)
            self._axes.add(prefix)
        self.run.log({tag: float(value), axis: int(step)})

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """Fan-out to every configured logger."""

    def __init__(self, loggers: list):
        self.loggers = loggers

    def add_scalar(self, tag: str, value, step: int) -> None:
        if value is None:
            return
        for lg in self.loggers:
            lg.add_scalar(tag, float(value), int(step))

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def make_loggers(names, run_dir: str, project: str = "laminar_jax", config: Optional[dict] = None) -> Optional[Loggers]:
    """The configured loggers (None when there are none)."""
    out = []
    for name in names:
        if name == "tensorboard":
            try:
                out.append(TensorBoardLogger(run_dir))
            except ImportError:  # TensorBoard output is optional; metrics.jsonl and the summary always exist
                pass
        elif name == "wandb":
            out.append(WandbLogger(run_dir, project, config))
        else:
            raise ConfigError(f"runtime.loggers={tuple(names)!r}: unknown logger {name!r}; "
                              f"known: ['tensorboard', 'wandb']")
    return Loggers(out) if out else None
