"""Flax NNX decoder-only transformer (Llama-3 / Qwen2 / Qwen3).

Parameters carry logical axis names (metadata ``out_sharding``) so the learner can map them
onto a mesh: 'vocab', 'embed', 'heads', 'kv_heads', 'mlp', 'norm', 'head_dim'.
Linear weights are stored [out, in] and named `weight`, as HF stores them (see `Linear`).
The decoder layers are one module whose parameters stack every layer's on a leading axis (logical
axis None), run as one ``lax.scan`` (`stack_layers`, `scan_layers`): compile time does not grow
with depth.

Training-path knobs (the decode path `forward_cached` never uses them): `forward(..., remat=...)`
rematerializes each decoder layer in the backward pass (see REMAT_POLICIES), and
`forward(..., with_logits=False)` + `logits_from_hidden` let a caller project the final hidden
states to logits a chunk of tokens at a time instead of materializing f32[B, T, V].
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.attention import AttentionFn, CacheBackend, dense_attention, train_attention
from laminar_jax.model.products import DEFAULT as DEFAULT_PRODUCTS, Products


def _init(init, axes: Sequence[Optional[str]]):
    # eager_sharding=False: parameters are created unsharded; the learner places them.
    return nnx.with_metadata(init, out_sharding=tuple(axes), eager_sharding=False)


def _low_precision(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype).itemsize < 4


class DropoutKey(nnx.Variable):
    """Raw key data u32[(L,) 2] of an adapter's dropout masks in one training forward (model/lora.py
    `with_dropout`): no parameter, never trained or saved, stacked like the weights it sits beside."""


class Linear(nnx.Module):
    """y = x . W^T + b with W stored [out, in] (HF's and torch's layout), named ``weight``.

    Why [out, in]: the product then contracts both operands' minor axis, which XLA:CPU's small-row
    kernels run faster than the [in, out] layout (they need not transpose the weight operand), and
    a decode step is mostly such products. HF checkpoints also load and export without a transpose.
    Low-precision (bf16/f16) products accumulate in float32 and the result is cast back to dtype;
    whether the product itself comes out in float32 or in dtype, and whether products of few rows
    run on a kernel, is the caller's ``products`` (model/products.py). ``axes`` are the logical axes
    of [in, out], as the shardings name them.
    """

    def __init__(self, din: int, dout: int, axes: Sequence[Optional[str]], bias: bool, rngs: nnx.Rngs,
                 dtype, param_dtype):
        self.dtype = dtype
        # Drawn [in, out] and transposed: a seed gives the same model as when weights were stored [in, out].
        w = nnx.initializers.normal(0.02)(rngs.params(), (din, dout), param_dtype).T
        self.weight = nnx.Param(w, out_sharding=(axes[1], axes[0]), eager_sharding=False)
        b = None
        if bias:
            rngs.params()  # the bias's draw (unused by zeros), so later modules get the same keys as before
            b = nnx.Param(jnp.zeros((dout,), param_dtype), out_sharding=tuple(axes[1:]), eager_sharding=False)
        self.bias = nnx.data(b)

    def __call__(self, x: jax.Array, products: Products = DEFAULT_PRODUCTS) -> jax.Array:
        w = self.weight[...]
        dtype = self.dtype or jnp.result_type(x, w)
        low = _low_precision(dtype)
        if products.takes(x, w):  # float32 out
            y = products.on_kernel(x.astype(dtype), w.astype(dtype))
        else:
            y = jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                    preferred_element_type=products.low_out if low else None)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        if getattr(self, "lora_a", None) is not None:  # adapters attached by model/lora.py `attach`
            y = y + self._lora(x.astype(dtype)).astype(y.dtype)
        return y.astype(dtype) if low else y

    def _lora(self, x: jax.Array) -> jax.Array:
        """scale * (x A^T) B^T: the low-rank path, never the merged [out, in] matrix (model/lora.py);
        x under the training forward's adapter dropout when `with_dropout` set its key."""
        key = getattr(self, "lora_dropout_key", None)
        if key is not None:
            keep = 1.0 - self.lora_dropout
            mask = jax.random.bernoulli(jax.random.wrap_key_data(key[...]), keep, x.shape)
            x = jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        h = jax.lax.dot_general(x, a, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        y = jax.lax.dot_general(h.astype(x.dtype), b, (((h.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y * self.lora_scale


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * w, normalised in float32 (as HF does)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return xf.astype(x.dtype) * self.weight[...].astype(x.dtype)


def rope_inv_freq(cfg: TransformerConfig) -> np.ndarray:
    """f32[head_dim/2] inverse frequencies, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    low_wav = s.original_max_position_embeddings / s.low_freq_factor
    high_wav = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wav, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wav) & ~(wavelen > low_wav)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: f[B, T, H, D]; positions: i32[B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # f32[B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype, param_dtype):
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        lin = functools.partial(Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = lin(d, cfg.num_heads * hd, ("embed", "heads"), cfg.qkv_bias)
        self.k_proj = lin(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg.qkv_bias)
        self.v_proj = lin(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg.qkv_bias)
        self.o_proj = lin(cfg.num_heads * hd, d, ("heads", "embed"), cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype)

    def __call__(self, x, positions, inv_freq, segment_ids=None, layer_cache=None, backend=None,
                 attn: AttentionFn = dense_attention, products: Products = DEFAULT_PRODUCTS):
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x, products).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x, products).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x, products).reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if backend is None:
            out, new_cache = attn(q, k, v, segment_ids), None
        else:
            out, new_cache = backend(q, k, v, layer_cache)
        return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim), products), new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype, param_dtype):
        lin = functools.partial(Linear, rngs=rngs, dtype=dtype, param_dtype=param_dtype, bias=cfg.mlp_bias)
        self.gate_proj = lin(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"))
        self.up_proj = lin(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"))
        self.down_proj = lin(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"))

    def __call__(self, x, products: Products = DEFAULT_PRODUCTS):
        return self.down_proj(jax.nn.silu(self.gate_proj(x, products)) * self.up_proj(x, products), products)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, dtype, param_dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.self_attn = Attention(cfg, rngs, dtype, param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.mlp = MLP(cfg, rngs, dtype, param_dtype)

    def __call__(self, x, positions, inv_freq, segment_ids=None, layer_cache=None, backend=None,
                 attn: AttentionFn = dense_attention, products: Products = DEFAULT_PRODUCTS):
        h, new_cache = self.self_attn(self.input_layernorm(x), positions, inv_freq, segment_ids, layer_cache,
                                      backend, attn, products)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), products), new_cache


# Per-layer activation checkpointing for the training forward (jax.checkpoint policies):
#   none: keep every activation for the backward pass (fastest, most memory);
#   full: keep only each layer's input, recompute the whole layer in the backward pass;
#   dots_saveable: keep all matmul outputs, incl. attention scores f32[B, H, T, T] (large at long T);
#   dots_with_no_batch_dims_saveable: keep the weight matmuls' outputs (q/k/v/o, MLP), recompute
#     attention and the elementwise ops.
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


def remat_policy(name: str) -> Optional[Any]:
    """The jax.checkpoint policy for a REMAT_POLICIES name (None for 'none')."""
    policies = jax.checkpoint_policies
    table = {"none": None, "full": policies.nothing_saveable, "dots_saveable": policies.dots_saveable,
             "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable}
    if name not in table:
        raise ValueError(f"remat={name!r}: must be one of {list(REMAT_POLICIES)}")
    return table[name]


def stack_layers(layers: Sequence[nnx.Module]) -> nnx.Module:
    """One module of the layers' graph whose every parameter stacks theirs on a new leading axis
    (layer l at index l), whose logical axis is None: no mesh ever splits the layer axis.

    Built from separately initialised layers, so a seed gives the same weights as unstacked layers."""
    graphdef, first = nnx.split(layers[0])

    def stack(*vs):
        axes = vs[0].get_metadata().get("out_sharding")
        value = jnp.stack([v.get_value() for v in vs])
        return vs[0].replace(value) if axes is None else vs[0].replace(value, out_sharding=(None, *axes))

    state = jax.tree.map(stack, first, *(nnx.state(m) for m in layers[1:]),
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def scan_layers(layers: nnx.Module, num_layers: int, x: jax.Array, carry: Any, layer_fn: Callable,
                policy: Any = None, remat: bool = False, unroll: bool = False):
    """x, carry after ``layer_fn(layer, x, carry, l)`` for l = 0..num_layers-1, as one ``lax.scan``
    over the stacked layers (``stack_layers``): one layer's program, compiled once whatever the
    depth. ``carry`` is any pytree threaded through the layers (a decode KV pool, updated in place).
    ``remat``: each layer under ``jax.checkpoint`` with ``policy`` (prevent_cse=False: in a scan
    the loop already keeps XLA from merging the recomputation into the forward pass)."""
    graphdef, state = nnx.split(layers)

    def one(state, x, carry, index):
        return layer_fn(nnx.merge(graphdef, state), x, carry, index)

    if remat:
        one = jax.checkpoint(one, policy=policy, prevent_cse=False)

    def body(xc, xs):
        return one(xs[0], *xc, xs[1]), None

    (x, carry), _ = jax.lax.scan(body, (x, carry), (state, jnp.arange(num_layers, dtype=jnp.int32)),
                                 unroll=True if unroll else 1)
    return x, carry


class ModelOutput(NamedTuple):
    logits: Optional[jax.Array]  # f32[B, T, V] (None when forward(with_logits=False))
    values: Optional[jax.Array]  # f32[B, T] when the model has a value head
    hidden: jax.Array  # f[B, T, D] final-normed hidden states


class Transformer(nnx.Module):
    """Decoder-only LM. ``model(tokens)`` -> f32[B, T, V] logits."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, value_head: bool = False):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
            embedding_init=_init(nnx.initializers.normal(0.02), ("vocab", "embed")), rngs=rngs)
        # Stacked (leading layer axis) and run as a scan: compile time does not grow with depth.
        self.layers = stack_layers([DecoderLayer(cfg, rngs, dtype, param_dtype) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), False, rngs, dtype, param_dtype)
        if value_head:
            self.value_head = Linear(cfg.hidden_size, 1, ("embed", None), True, rngs, dtype, param_dtype)

    @property
    def has_value_head(self) -> bool:
        return hasattr(self, "value_head")

    def _trunk(self, tokens, positions, segment_ids, cache, backend, attn: AttentionFn = dense_attention,
               products: Products = DEFAULT_PRODUCTS, remat: str = "none", rows: Optional[Callable] = None,
               unroll: bool = False):
        """Final-normed hidden states and the cache after every layer (a scan; see scan_layers).

        backend None: training (``attn`` over segment_ids, each layer under the ``remat`` policy);
        else each layer calls ``backend(q, k, v, cache, layer)``. ``rows``: applied to each layer's
        input (the caller's sharding of the activations; see forward)."""
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg))  # static: from the config, never trained
        x = self.embed_tokens(tokens)

        def layer_fn(layer, x, cache, index):
            x = x if rows is None else rows(x)
            bound = None if backend is None else functools.partial(_at_layer, backend, index)
            return layer(x, positions, inv_freq, segment_ids, cache, bound, attn, products)

        x, cache = scan_layers(self.layers, self.cfg.num_layers, x, cache, layer_fn, remat_policy(remat),
                               remat=remat != "none", unroll=unroll)
        return self.norm(x), cache

    def logits_from_hidden(self, h: jax.Array, products: Products = DEFAULT_PRODUCTS) -> jax.Array:
        """lm_head projection of final-normed hidden states: f[..., D] -> f32[..., V] (as `forward`)."""
        return self._logits(h, products)

    def _logits(self, h, products: Products = DEFAULT_PRODUCTS):
        if self.cfg.tie_word_embeddings and products.takes(h, self.embed_tokens.embedding[...]):
            return products.on_kernel(h.astype(self.dtype), self.embed_tokens.embedding[...].astype(self.dtype))
        if self.cfg.tie_word_embeddings and _low_precision(self.dtype):
            # E[V, D] . h[N, D] -> [V, N], transposed: XLA:CPU's bf16 (f32-accumulating) kernel
            # takes this operand order several times faster than h . E^T.
            e = self.embed_tokens.embedding[...].astype(self.dtype)
            flat = h.reshape(-1, h.shape[-1]).astype(self.dtype)
            out = jax.lax.dot_general(e, flat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return out.T.reshape(*h.shape[:-1], -1)
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(h).astype(jnp.float32)
        return self.lm_head(h, products).astype(jnp.float32)

    def forward(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None, *, remat: str = "none",
                with_logits: bool = True, attention: str = "dense", attention_chunk: int = 1024,
                products: Products = DEFAULT_PRODUCTS, rows: Optional[Callable] = None) -> ModelOutput:
        """Training forward over a padded or packed batch.

        tokens: i32[B, T]; positions: i32[B, T] (default arange; restart per packed segment);
        segment_ids: i32[B, T], 0 = padding (default all ones).
        remat: per-layer activation checkpointing, one of REMAT_POLICIES (same values, less memory
          in the backward pass). with_logits=False skips the f32[B, T, V] projection (logits=None);
          use `logits_from_hidden` on chunks of `hidden` instead.
        attention: 'dense', 'chunked' (``attention_chunk`` query rows at a time), 'flash' (blocks of
          ``attention_chunk``) or 'pallas_gpu';
          same values, different memory and speed (see laminar_jax.model.attention).
        products: how the weight products run (model/products.py; the caller's platform picks it).
        rows: a function applied to each layer's input activations f[B, T, D] (the learner's sharding
          constraint: the scan's carry has no sharding of its own for the partitioner to follow).
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        attn = train_attention(attention, attention_chunk)
        h, _ = self._trunk(tokens, positions, segment_ids, None, None, attn, products, remat, rows)
        values = self.value_head(h, products)[..., 0].astype(jnp.float32) if self.has_value_head else None
        return ModelOutput(self._logits(h, products) if with_logits else None, values, h)

    def __call__(self, tokens, positions=None, segment_ids=None, products: Products = DEFAULT_PRODUCTS) -> jax.Array:
        return self.forward(tokens, positions, segment_ids, products=products).logits

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, cache: Any,
                       backend: CacheBackend, products: Products = DEFAULT_PRODUCTS,
                       unroll: bool = False) -> tuple[jax.Array, Any]:
        """Decode/prefill through a cache backend (see laminar_jax.model.attention).

        tokens, positions: i32[B, T]; cache: one backend-defined pytree for every layer (e.g. a KV
        pool holding every layer's pages), carried through the layers' scan: each layer calls
        ``backend(q, k, v, cache, layer)`` (layer: i32[], traced) and gets the cache back updated;
        products: how the weight products run (the engine's kernel choice, rollout/kernels.py);
        unroll: the layers' scan fully unrolled (the engine's kernel choice too).
        Returns (f32[B, T, V] logits, the cache after the last layer).
        """
        h, new_cache = self._trunk(tokens, positions, None, cache, backend, products=products, unroll=unroll)
        return self._logits(h, products), new_cache


def _at_layer(backend: CacheBackend, index: jax.Array, q, k, v, cache):
    return backend(q, k, v, cache, index)
