"""The kernel seam: the decode kernels an engine runs, chosen once and passed in explicitly.

``choose_decode_kernels`` is a pure function of (config names, platform, geometry, the model's
largest weight) that returns one frozen :class:`DecodeKernels`: the decode attention, the engine
programs' weight products (model/products.py) and the sampling argmax, with their names and the
reason for any fallback. The engine puts it in its compiled programs' static spec and hands the
products to the model's forward; nothing else in the engine or the model asks which platform it
runs on.

Kernels come from a registry. The portable ones (rollout/attention.py: ``live_pages``,
``gather_dense``, ``gather_gqa``, ``pool_scan``) serve every platform; a platform plugin
(``laminar_jax.kernels.PLUGINS``: the CPU's is laminar_jax/cpu/kernels.py) registers its own
kernels, or its own form of a portable one, when the seam loads it for that platform. Accelerator
kernels (Pallas paged attention on GPU and TPU) register the same way: ``register_attention`` with
the platforms they run on, a ``refuses`` check for the geometries they cannot take, and an
``auto_rank`` above the portable ones, plus their name in ``PLUGIN_ATTENTION`` so configs can name
them before the plugin is loaded.

An explicit name that cannot serve the platform or geometry is an error naming the config field
and the reason; 'auto' takes the highest-ranked kernel that serves and records why it passed over
the others (``DecodeKernels.reason``; the engine logs it and the run summary reports it).

Registering an accelerator kernel (a module listed in ``laminar_jax.kernels.PLUGINS[platform]``)::

    from laminar_jax.rollout import kernels as seam

    def refuses(g: seam.Geometry) -> str | None:  # why it cannot serve g, or None
        return None if g.head_dim % 16 == 0 else f"head_dim={g.head_dim} (multiples of 16)"

    seam.register_attention(seam.AttentionKernel("pallas_gpu_paged", decode_fn, refuses, auto_rank=10), "gpu")
    seam.PLUGIN_ATTENTION["pallas_gpu_paged"] = "gpu"  # (in this module, so configs may name it unloaded)

A kernel that reads another pool layout than the portable one (``attention.POOL_LAYOUT``) declares
it in ``pool_layout`` (the engine allocates its pools in that layout; pages leave it in one wire
layout whatever the pools'), and a kernel that is one custom call XLA cannot partition sets
``per_shard``: under tensor parallelism the engine runs it per KV-head shard (``over_mesh``).

The Pallas kernels register so (rollout/kernels_gpu.py on 'gpu', rollout/kernels_tpu.py on 'tpu',
both head-major and per-shard, ranked above ``live_pages``). Tests run them on the CPU in interpret
mode by passing ``make_decode(interpret=True)`` as an extra backend under their name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from laminar_jax.kernels import load_plugin, train_products
from laminar_jax.model.products import Products
from laminar_jax.rollout.attention import POOL_LAYOUT, DecodeBackend, gather_dense, gather_gqa, live_pages, pool_scan

AUTO = "auto"


class Geometry(NamedTuple):
    """What a decode kernel must serve: the attention's shape, the KV dtype and the TP width."""

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: Any = jnp.float32  # the KV values' (and the weights') dtype
    tensor_parallel: int = 1  # TP width of the engine's mesh (1: one device)
    pages_per_seq: int = 0  # the page table's width (kernels that tile the table need it)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


class AttentionKernel(NamedTuple):
    """A registered decode attention. ``fn`` has the DecodeBackend contract (rollout/attention.py)."""

    name: str
    fn: DecodeBackend
    refuses: Optional[Callable[[Geometry], Optional[str]]] = None  # why it cannot serve a geometry, or None
    auto_rank: int = 0  # 'auto' takes the highest-ranked kernel that serves; < 0: only when named
    needs_live_pages: bool = False  # the engine computes DecodeMeta.live (and its buckets) for it
    pool_layout: str = POOL_LAYOUT  # the KV pools' layout it reads (the engine allocates its pools so)
    per_shard: bool = False  # one custom call XLA cannot partition: under TP it runs per KV-head shard


# Attention kernels that plugins register, with their platform: config validation and error
# messages know them without loading the plugin.
PLUGIN_ATTENTION: dict[str, str] = {"cpu_kernel": "cpu", "pallas_gpu_paged": "gpu", "pallas_tpu_paged": "tpu"}
# Weight-product policies only a plugin serves, with its platform.
PLUGIN_PRODUCTS: dict[str, str] = {"native": "cpu"}
PRODUCT_POLICIES = ("auto", "native", "xla")

_ANY = "*"
_ATTENTION: dict[tuple[str, str], AttentionKernel] = {}  # (platform or '*', name) -> kernel
# platform -> (policy, geometry, largest weight, field) -> (Products, reason); raises for an explicit policy it cannot serve
_PRODUCTS: dict[str, Callable[..., tuple[Products, str]]] = {}
_ARGMAX: dict[str, Callable[[Geometry], Optional[tuple[Callable, str]]]] = {}  # platform -> (fn, name) or None
_UNROLL: dict[str, bool] = {}  # platform -> its engine programs unroll the layers' scan


def register_attention(kernel: AttentionKernel, platform: str = _ANY) -> None:
    """Offer ``kernel`` on ``platform`` ('*': every platform). A platform's entry of a name replaces
    the portable one there (the CPU plugin's ``live_pages``)."""
    _ATTENTION[(platform, kernel.name)] = kernel


def register_products(platform: str, chooser: Callable[..., tuple[Products, str]]) -> None:
    _PRODUCTS[platform] = chooser


def register_layer_unroll(platform: str, unroll: bool) -> None:
    """Whether ``platform``'s engine programs run the layers' scan fully unrolled (straight-line
    code per layer instead of a loop over the stacked weights)."""
    _UNROLL[platform] = unroll


def register_argmax(platform: str, chooser: Callable[[Geometry], Optional[tuple[Callable, str]]]) -> None:
    _ARGMAX[platform] = chooser


for _fn, _rank in ((live_pages, 1), (gather_dense, -1), (gather_gqa, -1), (pool_scan, -1)):
    register_attention(AttentionKernel(_fn.__name__, _fn, auto_rank=_rank,
                                       needs_live_pages=getattr(_fn, "needs_live_pages", False)))


def attention_names() -> tuple[str, ...]:
    """Every decode attention name a config may give (besides 'auto')."""
    return tuple(sorted({name for _, name in _ATTENTION} | set(PLUGIN_ATTENTION)))


def _offered(platform: str) -> dict[str, AttentionKernel]:
    out = {name: k for (p, name), k in _ATTENTION.items() if p == _ANY}
    out.update({name: k for (p, name), k in _ATTENTION.items() if p == platform})
    return out


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """The kernels one engine runs (hashable: part of its compiled programs' static spec)."""

    attention: str  # the decode attention's name
    attend: DecodeBackend
    products: Products  # the engine programs' weight products
    argmax: Callable  # sampling's first maximum per row (xla_argmax, or a kernel picking the same index)
    argmax_name: str
    platform: str
    needs_live_pages: bool = False
    reason: str = ""  # why 'auto' passed over a faster kernel ('' when nothing was passed over)
    pool_layout: str = POOL_LAYOUT  # the KV pools' layout the attention reads
    per_shard: bool = False  # the attention runs per tensor-parallel shard (see over_mesh)
    unroll_layers: bool = False  # the layers' scan fully unrolled (a platform's choice: register_layer_unroll)

    def over_mesh(self, mesh, axis: str) -> "DecodeKernels":
        """These kernels for an engine on ``mesh`` (TP over ``axis``): a per-shard attention wrapped to run
        on each shard's KV heads (head_major.shard_over_kv_heads); the others as they are (GSPMD
        partitions them). Equal meshes give equal kernels, so equal engines share compiled programs."""
        if not self.per_shard or mesh.shape.get(axis, 1) == 1:
            return self
        return dataclasses.replace(self, attend=_per_shard(self.attend, mesh, axis))

    @property
    def products_name(self) -> str:
        p = self.products
        return f"kernel<={p.kernel_rows} rows" if p.kernel is not None else "xla"

    def summary(self) -> dict:
        """The run summary's ``decode_kernel`` entry."""
        out = {"attention": self.attention, "weight_products": self.products_name, "argmax": self.argmax_name,
               "platform": self.platform}
        if self.reason:
            out["fallback"] = self.reason
        return out


def choose_attention(name: str, platform: str, geometry: Geometry, extra: Optional[dict] = None,
                     field: str = "rollout.attention_impl") -> tuple[AttentionKernel, str]:
    """(the attention kernel for config name ``name``, why 'auto' passed over others or '').

    ``extra``: caller-supplied backends {name: fn} (``Engine(attention_backends=)``), taken only when named."""
    load_plugin(platform)
    offered = _offered(platform)
    for key, fn in (extra or {}).items():
        offered[key] = AttentionKernel(key, fn, auto_rank=-1, needs_live_pages=getattr(fn, "needs_live_pages", False),
                                       pool_layout=getattr(fn, "pool_layout", POOL_LAYOUT),
                                       per_shard=getattr(fn, "per_shard", False))
    if name != AUTO:
        kernel = offered.get(name)
        home = PLUGIN_ATTENTION.get(name)
        if kernel is None and home is not None and home != platform:
            raise ValueError(f"{field}={name!r} cannot run off {home.upper()} (this engine runs on {platform}); "
                             f"use 'auto' or a portable kernel (live_pages)")
        if kernel is None:
            raise ValueError(f"{field}={name!r}: not a decode attention here; one of {sorted(offered)} or 'auto'")
        why = kernel.refuses(geometry) if kernel.refuses else None
        if why:
            raise ValueError(f"{field}={name!r} cannot run {why}; use 'live_pages' or 'auto'")
        return kernel, ""
    skipped = []
    for kernel in sorted((k for k in offered.values() if k.auto_rank >= 0), key=lambda k: -k.auto_rank):
        why = kernel.refuses(geometry) if kernel.refuses else None
        if why is None:
            return kernel, "; ".join(skipped)
        skipped.append(f"{kernel.name} cannot run {why}")
    raise ValueError(f"{field}='auto': no decode attention serves {geometry} on {platform}")  # live_pages serves all


def choose_products(policy: str, platform: str, geometry: Geometry, largest_weight: int,
                    field: str = "rollout.weight_products") -> tuple[Products, str]:
    """(the engine's weight products for ``policy``, why 'auto' took no kernel or '')."""
    if policy not in PRODUCT_POLICIES:
        raise ValueError(f"{field}={policy!r}: one of {list(PRODUCT_POLICIES)}")
    load_plugin(platform)
    chooser = _PRODUCTS.get(platform)
    if chooser is not None:
        return chooser(policy, geometry, largest_weight, field)
    home = PLUGIN_PRODUCTS.get(policy)
    if home is not None:
        raise ValueError(f"{field}={policy!r} cannot run off {home.upper()} (this engine runs on {platform}); "
                         f"use 'auto' or 'xla'")
    return train_products(platform), ""


def xla_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis as i32: the index sampling.first_argmax defines (the first maximum,
    a NaN counting as the maximum) in one variadic reduction, which accelerators fuse into one pass
    over the logits (first_argmax's max, compare and min take several: it is XLA:CPU's form)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def choose_argmax(platform: str, geometry: Geometry) -> tuple[Callable, str]:
    """Sampling's argmax: a platform's choice (the CPU plugin's), else jnp.argmax; each picks the index
    sampling.first_argmax picks."""
    load_plugin(platform)
    chooser = _ARGMAX.get(platform)
    picked = chooser(geometry) if chooser is not None else None
    return picked if picked is not None else (xla_argmax, "xla")


def choose_decode_kernels(attention_impl: str, weight_products: str, *, platform: str, geometry: Geometry,
                          largest_weight: int, extra_attention: Optional[dict] = None,
                          prefix: str = "rollout") -> DecodeKernels:
    """The one kernel choice of an engine (see the module docstring)."""
    kernel, why_attention = choose_attention(attention_impl, platform, geometry, extra_attention,
                                             f"{prefix}.attention_impl")
    products, why_products = choose_products(weight_products, platform, geometry, largest_weight,
                                             f"{prefix}.weight_products")
    argmax, argmax_name = choose_argmax(platform, geometry)
    reason = "; ".join(r for r in (why_attention, why_products) if r)
    return DecodeKernels(kernel.name, kernel.fn, products, argmax, argmax_name, platform, kernel.needs_live_pages,
                         reason, kernel.pool_layout, kernel.per_shard, _UNROLL.get(platform, False))


@functools.lru_cache(maxsize=64)
def _per_shard(attend: DecodeBackend, mesh, axis: str) -> DecodeBackend:
    from laminar_jax.rollout.head_major import shard_over_kv_heads

    return shard_over_kv_heads(attend, mesh, axis)


def resolve_backend(name: str, *, platform: str, tensor_parallel: bool, page_size: int, head_dim: int,
                    group: int, field: str = "rollout.attention_impl") -> str:
    """The decode attention's name for config name ``name`` (group: query heads per KV head)."""
    geometry = Geometry(group, 1, head_dim, page_size, jnp.float32, 2 if tensor_parallel else 1)
    return choose_attention(name, platform, geometry, field=field)[0].name
