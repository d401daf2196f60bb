"""Token sampling: greedy, temperature, top-k, top-p, per slot, keyed per token.

Key schedule: token ``t`` (0-based index among the sequence's generated tokens) of a sequence
with key ``key_s`` is drawn with ``jax.random.fold_in(key_s, t)``. The draw depends on nothing
else (not the slot, not the batch), so a sequence moved to another engine samples identically.

Behaviour log-prob (what the learner's importance ratio divides by). We return the log-prob of
the token under the distribution *actually sampled from*:

    lp = token_logprobs(where(keep, logits, -inf), token, T)
       = log softmax(logits_kept / T)[token]

where ``keep`` is the top-k / top-p support (renormalised over the kept tokens). With top_k=0
and top_p=1 nothing is masked and ``lp == token_logprobs(logits, token, T)`` exactly, which is
what the learner recomputes (log softmax(logits / T)). With truncation, the learner's full-vocab
log-prob is <= ours (the kept mass is < 1); a learner that wants the exact ratio must apply the
same truncation. Greedy (T = 0) returns ``token_logprobs(logits, token, 1.0)`` (the untempered
model log-prob of the argmax token), since a point mass has no useful log-prob.

Top-k keeps logits >= the k-th largest (ties at the threshold are all kept). Top-p keeps the
smallest prefix of the (top-k-restricted, tempered) sorted distribution whose mass reaches p.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from laminar_jax.model import token_logprobs
from laminar_jax.configlib import expect


def validate_sampling(prefix: str, temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    """Shared checks for the config defaults and for per-request SamplingParams."""
    expect(temperature >= 0.0, f"{prefix}.temperature", temperature, ">= 0 (0 = greedy)")
    expect(top_k >= 0, f"{prefix}.top_k", top_k, ">= 0 (0 = off)")
    expect(0.0 < top_p <= 1.0, f"{prefix}.top_p", top_p, "in (0, 1]")
    expect(max_new_tokens >= 1, f"{prefix}.max_new_tokens", max_new_tokens, ">= 1")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling.

    Attributes:
      temperature: 0 = greedy; otherwise logits are divided by it before softmax.
      top_k: Keep the k most likely tokens; 0 = off.
      top_p: Keep the smallest set with mass >= top_p; 1 = off.
      max_new_tokens: Stop after this many generated tokens; a request whose prompt + max_new_tokens
        exceeds rollout.max_total_len is rejected (ValueError naming both), never cut.
      stop_token_ids: Generation ends after emitting one of these (the stop token is kept). None (the
        default) means the server's default stop ids (rollout.stop_token_ids, else the model's EOS ids);
        () never stops early.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: Optional[tuple[int, ...]] = None

    def validate(self, prefix: str = "sampling") -> None:
        validate_sampling(prefix, self.temperature, self.top_k, self.top_p, self.max_new_tokens)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = None if self.stop_token_ids is None else list(self.stop_token_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SamplingParams":
        return cls(temperature=float(d["temperature"]), top_k=int(d["top_k"]), top_p=float(d["top_p"]),
                   max_new_tokens=int(d["max_new_tokens"]),
                   stop_token_ids=None if d["stop_token_ids"] is None else tuple(int(x) for x in d["stop_token_ids"]))


def default_sampling(section, eos_ids: tuple[int, ...], max_new_tokens: Optional[int] = None) -> SamplingParams:
    """SamplingParams from a RolloutSection's defaults (stop ids default to the model's eos ids)."""
    stop = eos_ids if section.stop_token_ids is None else section.stop_token_ids
    return SamplingParams(section.temperature, section.top_k, section.top_p,
                          max_new_tokens or section.max_new_tokens, tuple(stop))


def _truncation_mask(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool[B, V]: the top-k / top-p support. logits f32[B, V]; temperature f32[B] (> 0); top_k i32[B]; top_p f32[B]."""
    v = logits.shape[-1]
    srt = -jnp.sort(-logits, axis=-1)  # f32[B, V] descending
    rank = jnp.arange(v)[None, :]
    in_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(in_k, srt / temperature[:, None], -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # rank 0 is always kept (mass_before = 0 < p); p >= 1 keeps all (cumsum may round past 1).
    kept = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_kept = jnp.sum(kept, axis=-1)
    threshold = jnp.take_along_axis(srt, (n_kept - 1)[:, None], axis=-1)  # f32[B, 1]
    return logits >= threshold


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) (first index of the maximum; a NaN counts as the maximum), as i32.

    Why not jnp.argmax: XLA:CPU lowers it to a variadic (value, index) reduction that does not
    vectorise; a max, a compare and a min-reduction of indices vectorise, an order of magnitude
    faster over a vocabulary, and pick the same index.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, idx, x.shape[-1]), axis=-1).astype(jnp.int32)


def token_keys(key_data: jax.Array, counts: jax.Array) -> jax.Array:
    """The key schedule: typed keys fold_in(key_s, t) for each sequence's raw key ``key_data``
    (u32[S, K]) and token index ``counts`` (i32[..., S]; leading axes, e.g. a call's steps, share
    the sequences' keys)."""
    fold = jax.vmap(jax.random.fold_in)
    for _ in range(counts.ndim - 1):
        fold = jax.vmap(fold, in_axes=(None, 0))
    return fold(jax.random.wrap_key_data(key_data), counts)


def gumbel_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """f32[..., V]: the Gumbel draw of each typed key in ``keys`` (any shape), as jax.random.categorical makes it.

    Elementwise in the keys, so drawing a whole call's [steps, rows] keys at once gives each
    (sequence, token) the same draw as drawing it in its own step.
    """
    draw = lambda k: jax.random.gumbel(k, (vocab,), jnp.float32)  # noqa: E731
    for _ in range(keys.ndim):
        draw = jax.vmap(draw)
    return draw(keys)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, noise: Optional[jax.Array] = None,
                  argmax: Callable[[jax.Array], jax.Array] = first_argmax) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row.

    logits f32[B, V]; keys: typed PRNG keys [B] (already folded with the token index);
    temperature f32[B] (0 = greedy); top_k i32[B]; top_p f32[B]. ``noise``: f32[B, V], the rows'
    ``gumbel_noise(keys)`` drawn beforehand (keys then unused); the tokens are the same either way.
    ``argmax``: first_argmax, or a function that picks the same index (the engine's native kernel).
    Returns (tokens i32[B], behaviour log-probs f32[B]); see the module docstring for the log-prob.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    temp = jnp.where(greedy, 1.0, temperature)
    truncate = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~greedy)
    keep = jax.lax.cond(truncate, lambda: _truncation_mask(logits, temp, top_k, top_p),
                        lambda: jnp.ones(logits.shape, bool))
    kept = jnp.where(keep, logits, -jnp.inf)
    # All-greedy batches skip the draw (threefry bits for every [row, vocab] entry); greedy rows
    # ignore `drawn`, so each row's token and log-prob are the same on either branch.
    # Gumbel-max: the same draw as jax.random.categorical(key, kept / temp).
    if noise is None:
        drawn = jax.lax.cond(jnp.any(~greedy),
                             lambda: argmax(gumbel_noise(keys, logits.shape[-1]) + kept / temp[:, None]),
                             lambda: jnp.zeros(logits.shape[:1], jnp.int32))
    else:
        drawn = argmax(noise + kept / temp[:, None])
    tokens = jnp.where(greedy, argmax(logits), drawn)
    lp = token_logprobs(jnp.where(greedy[:, None], logits, kept), tokens, temp[:, None])
    return tokens, lp
