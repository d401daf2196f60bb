"""Supervised warm-start on reference responses: before RL in the CPU demo, or alone (launch/sft.py).

A tiny randomly initialised model cannot find the synthetic task's format by sampling alone; a
few hundred supervised steps give it the format, and RL then has to learn the lengths.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from laminar_jax.model import Transformer, token_logprobs
from laminar_jax.model.precision import cast_floating


def pack_examples(pairs: Sequence[tuple], seq_len: int):
    """(prompt_ids, response_ids[, response_mask]) -> tokens i32[N, L], loss mask f32[N, L] on
    response targets: one example per row, cut to L (pack_rows packs several into a row)."""
    tokens = np.zeros((len(pairs), seq_len), np.int32)
    mask = np.zeros((len(pairs), seq_len), np.float32)
    for i, pair in enumerate(pairs):
        _place(tokens, mask, i, 0, _cut(pair, seq_len))
    return tokens, mask


def sft_schedule(lr: float, steps: int) -> optax.Schedule:
    """Linear warm-up over the first tenth of `steps`, then cosine decay to 0. A single step runs at
    `lr`: the warm-up starts at 0 (its one step would change nothing) and leaves no step to decay."""
    if steps < 2:
        return optax.constant_schedule(lr)
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps)


def _place(tokens, mask, row: int, at: int, pair) -> int:
    """Write one (prompt, response[, response_mask]) example that fits into ``tokens[row, at:]`` with
    its loss mask; returns its length. Target t+1 is predicted at position t; only response tokens
    are trained on (a third element, data/sft.py's multi-turn traces, masks observations out)."""
    p, r, *m = pair
    ids = list(p) + list(r)
    n = len(ids)
    tokens[row, at:at + n] = ids
    start, end = len(p) - 1, n - 1
    lo, hi = max(start, 0), max(end, 0)
    mask[row, at + lo:at + hi] = 1.0 if not m else np.asarray(m[0], np.float32)[lo - start:hi - start]
    return n


def pack_rows(pairs: Sequence[tuple], seq_len: int, order: Sequence[int]):
    """Examples in ``order`` packed one after another into rows of ``seq_len`` tokens (a new row when
    the next one does not fit): tokens i32[R, L], loss mask f32[R, L], segment ids i32[R, L] (1, 2, ...
    per example, 0 = padding) and positions i32[R, L] (restarting at 0 in each example). An example's
    last position predicts nothing (its mask ends before it), so no loss crosses into the next one;
    attention stays within a segment (the model's packed path). Examples longer than a row are cut."""
    rows: list[list[int]] = [[]]
    used = 0
    for i in order:
        n = min(len(pairs[i][0]) + len(pairs[i][1]), seq_len)
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(int(i))
        used += n
    tokens = np.zeros((len(rows), seq_len), np.int32)
    mask = np.zeros((len(rows), seq_len), np.float32)
    segs = np.zeros((len(rows), seq_len), np.int32)
    positions = np.zeros((len(rows), seq_len), np.int32)
    for row, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            n = _place(tokens, mask, row, at, _cut(pairs[i], seq_len))
            segs[row, at:at + n] = k + 1
            positions[row, at:at + n] = np.arange(n)
            at += n
    return tokens, mask, segs, positions


def _cut(pair, seq_len: int):
    """The example cut to seq_len tokens (the prompt first); one that fits is unchanged."""
    p, r, *m = pair
    keep = max(seq_len - len(p), 0)
    return (list(p)[:seq_len], list(r)[:keep], *[list(x)[:keep] for x in m])


def sft_warmup(model: Transformer, pairs: Sequence[tuple], steps: int, lr: float,
               batch_size: int = 32, seed: int = 0) -> list[float]:
    """Train `model` in place with cross-entropy on the response tokens; returns the loss curve.
    Trained as float32 master weights (as the learner's), written back in the model's own dtype.

    Each step trains on about `batch_size` examples, packed into a fixed number of rows (as many as
    hold that many at the packing's density): a task whose lengths are heavy-tailed would otherwise
    pad every example to the longest one, and spend most of each step on padding. Examples are drawn without
    replacement, an epoch at a time in a fresh random order."""
    if steps <= 0 or not pairs:
        return []
    seq_len = max(len(p) + len(r) for p, r, *_ in pairs)
    seq_len = 1 << (seq_len - 1).bit_length()
    rng = np.random.default_rng(seed)
    packed = pack_rows(pairs, seq_len, rng.permutation(len(pairs)))
    # As many rows as hold batch_size examples at the packing's density (long examples leave gaps).
    rows_per_step = max(1, int(np.ceil(min(batch_size, len(pairs)) * len(packed[0]) / len(pairs))))
    graphdef, stored, rest = nnx.split(model, nnx.Param, ...)
    params = cast_floating(stored, jnp.float32)
    opt = optax.adamw(sft_schedule(lr, steps), weight_decay=0.0)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, toks, msk, sg, pos):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest)
            logits = m(toks, positions=pos, segment_ids=sg)
            lp = token_logprobs(logits[:, :-1], toks[:, 1:])
            mm = msk[:, :-1]
            return -(lp * mm).sum() / jnp.maximum(mm.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses: list[float] = []
    next_row = 0
    for _ in range(steps):
        if next_row + rows_per_step > len(packed[0]):
            packed, next_row = pack_rows(pairs, seq_len, rng.permutation(len(pairs))), 0
            if len(packed[0]) < rows_per_step:  # fewer examples than a step's rows: repeat them
                packed = tuple(np.resize(a, (rows_per_step, seq_len)) for a in packed)
        batch = tuple(a[next_row:next_row + rows_per_step] for a in packed)
        next_row += rows_per_step
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
    nnx.update(model, jax.tree.map(lambda new, old: new.astype(old.dtype), params, stored))
    return losses


class OutDirError(ValueError):
    """`--out` cannot take the export: a file, a non-empty directory without overwrite, not writable."""


def claim_out_dir(out_dir: str, overwrite: bool) -> str:
    """Check `out_dir` before any training and return an empty staging directory beside it (same
    file system) that the export is written into; `commit_out_dir` then puts it in place, so a
    failed run never leaves a half-written directory and an overwrite leaves no stale file."""
    out = os.path.realpath(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutDirError(f"--out={out_dir}: is a file, not a directory")
    n = len(os.listdir(out)) if os.path.isdir(out) else 0
    if n and not overwrite:
        raise OutDirError(f"--out={out_dir}: directory is not empty ({n} entr{'y' if n == 1 else 'ies'}); "
                          "pass --overwrite to replace its contents, or name a new directory")
    if os.path.isdir(out) and not os.access(out, os.W_OK | os.X_OK):
        raise OutDirError(f"--out={out_dir}: directory is not writable")
    parent = os.path.dirname(out)
    above = parent
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise OutDirError(f"--out={out_dir}: {above} is a file, not a directory")
    try:
        os.makedirs(parent, exist_ok=True)
        staging = os.path.join(parent, f".{os.path.basename(out)}.sft-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(staging)  # the mode the directory would get (umask), unless it exists:
        if os.path.isdir(out):
            os.chmod(staging, os.stat(out).st_mode & 0o7777)  # then the mode it has
    except OSError as e:
        raise OutDirError(f"--out={out_dir}: cannot write beside it in {parent} ({e.strerror or e})") from e
    return staging


def commit_out_dir(staging: str, out_dir: str) -> None:
    """Put the finished export in place of `out_dir` (replacing what it held, when overwriting)."""
    out = os.path.realpath(out_dir)
    if os.path.isdir(out) and os.listdir(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "replaced"))
        os.rename(staging, out)
        shutil.rmtree(old)
    else:
        os.rename(staging, out)  # over an empty directory, or where there was none


def run_sft(cfg, out_dir: str, steps: Optional[int] = None, log: Callable[[str], None] = print,
            overwrite: bool = False) -> dict:
    """Supervised warm-start alone: the config's model, `steps` (default runtime.sft_warmup_steps) at
    runtime.sft_lr on data's (prompt, response) pairs, exported to `out_dir` as a HF directory
    (checked first: a non-empty one is refused unless `overwrite`, which replaces its contents).

    Returns a summary: pairs used, steps, first/last loss (mean of the first/last 10 steps), out_dir.
    """
    from laminar_jax.data.sft import sft_pairs
    from laminar_jax.model import build_model, load_tokenizer
    from laminar_jax.model.export import write_hf_dir

    steps = cfg.runtime.sft_warmup_steps if steps is None else steps
    if steps < 1:
        from laminar_jax.configlib import ConfigError

        raise ConfigError(f"SFT steps={steps}: set runtime.sft_warmup_steps (or --steps) to >= 1")
    staging = claim_out_dir(out_dir, overwrite)
    try:
        tok = load_tokenizer(cfg.model.tokenizer)
        pairs, counts = sft_pairs(cfg.data, tok, max_total_len=cfg.rollout.max_total_len, seed=cfg.seed + 1)
        log(f"sft: {len(pairs)} (prompt, response) pairs {counts}; building the model")
        model = build_model(cfg.model)
        log(f"sft: {steps} steps at lr {cfg.runtime.sft_lr} (the first one compiles)")
        losses = sft_warmup(model, pairs, steps, cfg.runtime.sft_lr, seed=cfg.seed)
        write_hf_dir(model, cfg.model, staging)
        commit_out_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"sft: exported to {out_dir}")
    head, tail = losses[:10], losses[-10:]
    return {"out_dir": out_dir, "pairs": len(pairs), "steps": steps, **{f"data_{k}": v for k, v in counts.items()},
            "loss_first": float(np.mean(head)), "loss_last": float(np.mean(tail))}
