"""Weight publishing: the Publisher protocol, an in-memory LocalPublisher, and the async host copy.

After a step the learner starts device-to-host copies of the policy weights
(`jax.Array.copy_to_host_async`) and a worker thread turns them into numpy and calls
`publisher.publish(version, flat_params)`. The learner's only wait is `HostCopy.wait_copied()`
right before the next *donating* train_step (the prepare pass, collation and placement of the
next batch overlap with the copy); the publish call itself never blocks the learner.
"""

from __future__ import annotations

import threading
import traceback
from concurrent.futures import Executor
from typing import Any, Optional, Protocol, runtime_checkable

import jax
import numpy as np

from laminar_jax.naming import host_arrays, path_name, start_host_copies


@runtime_checkable
class Publisher(Protocol):
    """Receives host copies of the policy weights. Implemented by the relay plane."""

    def publish(self, version: int, params: dict[str, np.ndarray]) -> None:
        """params: flat {'layers.0.self_attn.q_proj.weight': np.ndarray, ...}; version strictly increasing."""
        ...


class LocalPublisher:
    """In-memory publisher for tests and the single-process loop: keeps the newest `keep` versions."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._lock = threading.Lock()
        self._versions: dict[int, dict[str, np.ndarray]] = {}

    def publish(self, version: int, params: dict[str, np.ndarray]) -> None:
        with self._lock:
            if self._versions and version <= max(self._versions):
                raise ValueError(f"publish: version {version} is not newer than {max(self._versions)}")
            self._versions[version] = params
            for v in sorted(self._versions)[:-self.keep]:
                del self._versions[v]

    def latest(self) -> tuple[int, dict[str, np.ndarray]] | None:
        with self._lock:
            if not self._versions:
                return None
            v = max(self._versions)
            return v, self._versions[v]

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)


def flatten_params(state: Any, drop: tuple[str, ...] = ("value_head",)) -> dict[str, Any]:
    """nnx.State -> {'a.b.c': leaf} (the one naming, laminar_jax.naming), skipping subtrees whose
    first key is in `drop`."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = path_name(path)
        if name.split(".")[0] not in drop:
            out[name] = leaf
    return out


class HostCopy:
    """One in-flight publish: D2H copies started now; numpy conversion + publish on a worker.

    The learner's stall is `wait_copied`, which converts in the caller when the worker has not
    yet: on busy cores a hand-off to a thread that still has to be scheduled costs milliseconds,
    more than the copy itself. With an `executor` (one worker, so versions stay in order) no
    thread is started per publish either.
    """

    def __init__(self, version: int, flat: dict[str, jax.Array], publisher: Optional[Publisher],
                 executor: Optional[Executor] = None):
        self.version = version
        self._copied = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: Optional[str] = None
        self.host: Optional[dict[str, np.ndarray]] = None
        if all(x.is_fully_addressable for x in flat.values()):
            # The relay plane's own host copies are the same call.
            self._flat = dict(zip(flat, start_host_copies(list(flat.values()))))
        else:  # multi-process (blocking): gathered to process 0 only, one tensor at a time (learner/gather.py)
            from laminar_jax.learner.gather import gather_to_root
            self._flat = gather_to_root(flat) or {}
        if executor is not None:
            executor.submit(self._run, publisher)
        else:
            threading.Thread(target=self._run, args=(publisher,), daemon=True, name=f"publish-v{version}").start()

    def _convert(self, timeout: Optional[float] = None) -> None:
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"weight version {self.version}: device-to-host copy not done after {timeout}s")
        try:
            if self.host is None:
                self.host = {k: np.asarray(v) for k, v in self._flat.items()}
                self._flat = None
        finally:
            self._lock.release()
            self._copied.set()

    def _run(self, publisher: Optional[Publisher]) -> None:
        try:
            self._convert()
            if publisher is not None:
                publisher.publish(self.version, self.host)
        except BaseException:  # recorded; the owner re-raises it in check()
            self._error = traceback.format_exc()
        finally:
            self._copied.set()
            self._done.set()

    def wait_copied(self, timeout: float) -> None:
        """Block until the host copy exists (device buffers may then be donated)."""
        if not self._copied.is_set():
            self._convert(timeout)
        self.check()

    def wait_done(self, timeout: float) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"weight version {self.version}: publisher.publish did not return after {timeout}s")
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing weight version {self.version} failed:\n{self._error}")


def unflatten_params(flat: dict[str, Any], template: Any, drop: tuple[str, ...] = ("value_head",)) -> Any:
    """Inverse of `flatten_params` (the one naming of weights on the wire): flat host arrays -> a
    pytree shaped like `template`; leaves absent from `flat` (e.g. a dropped value head) keep the template's."""
    state_names = list(flatten_params(template, drop=()).keys())
    leaves, treedef = jax.tree_util.tree_flatten(template)
    if len(state_names) != len(leaves):
        raise ValueError(f"param naming mismatch: {len(state_names)} names for {len(leaves)} leaves")
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(flat[n]) if n in flat else leaf
                                                  for n, leaf in zip(state_names, leaves)])


def model_params(model) -> dict[str, np.ndarray]:
    """Every parameter of an nnx model (value head included), flat and on the host."""
    from flax import nnx

    return host_arrays(flatten_params(nnx.split(model)[1], drop=()))


def load_model_params(model, flat: dict[str, np.ndarray]) -> None:
    """Inverse of model_params: overwrite `model`'s parameters in place (names and shapes must match)."""
    from flax import nnx

    state = nnx.split(model)[1]
    expected = flatten_params(state, drop=())
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise ValueError(f"initial learner params: {len(missing)} parameters missing (e.g. {missing[:3]})")
    for n, leaf in expected.items():
        if tuple(np.shape(flat[n])) != tuple(np.shape(leaf)):
            raise ValueError(f"initial learner params: {n} has shape {np.shape(flat[n])}, the model {np.shape(leaf)}")
    nnx.update(model, unflatten_params(flat, state, drop=()))


def adapters_of(flat: dict[str, Any]) -> dict[str, Any]:
    """The adapter tensors of a LoRA actor's flat params ('<module>.lora_a' / '.lora_b', model/lora.py)."""
    from laminar_jax.model.lora_version import SUFFIX_A, SUFFIX_B

    return {n: x for n, x in flat.items() if n.endswith((SUFFIX_A, SUFFIX_B))}


def base_of(flat: dict[str, Any]) -> dict[str, Any]:
    """Everything but the adapters: the frozen base a LoRA actor's adapters apply to."""
    adapters = adapters_of(flat)
    return {n: x for n, x in flat.items() if n not in adapters}


class AdapterPublisher:
    """A LoRA learner's publisher: each version (its adapters, host arrays) goes on with the base's
    identity and the scale (model/lora_version.adapter_version), the only other bytes it carries."""

    def __init__(self, publisher: Publisher, base_id: str, scale: float):
        self.publisher, self.base_id, self.scale = publisher, base_id, scale

    def publish(self, version: int, params: dict[str, np.ndarray]) -> None:
        from laminar_jax.model.lora_version import adapter_version

        self.publisher.publish(version, adapter_version(params, self.base_id, self.scale))


class LoraVersions:
    """A LoRA learner's versions (learner.lora): the adapters only, with the frozen base's identity
    and the scale. ``base_flat()`` gives the frozen base, flat, in the serving dtype (device)."""

    def __init__(self, scale: float, base_flat):
        self.scale, self._base_flat = scale, base_flat
        self._base_id: Optional[str] = None

    @classmethod
    def of(cls, section, base_flat) -> Optional["LoraVersions"]:
        lora = getattr(section, "lora", None)
        return cls(lora.scale, base_flat) if lora is not None and lora.enabled else None

    def base(self) -> dict[str, np.ndarray]:
        """Host copy of the frozen base as servers hold it (the serving dtype, no value head)."""
        return host_arrays(base_of(self._base_flat()))

    @property
    def base_id(self) -> str:
        """base_identity of `base()`; the base is frozen, so computed once. A multi-process learner's
        base spans processes: its identity is set by `weights.lora_base.share_base` (a collective)."""
        if self._base_id is None:
            from laminar_jax.model.lora_version import base_identity

            if not all(x.is_fully_addressable for x in self._base_flat().values()):
                raise RuntimeError("learner.lora: the frozen base spans several learner processes; its identity "
                                   "is gathered once by LearnerGroup.lora_base before a version is published")
            self._base_id = base_identity(self.base())
        return self._base_id

    def set_base_id(self, base_id: Optional[str]) -> None:
        """The frozen base's identity, known from elsewhere (the run's base store, or process 0's
        gather), or None: the base was replaced, recompute it."""
        self._base_id = base_id

    def version(self, adapters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from laminar_jax.model.lora_version import adapter_version

        return adapter_version(adapters, self.base_id, self.scale)

    def wrap(self, publisher: Publisher) -> "AdapterPublisher":
        return AdapterPublisher(publisher, self.base_id, self.scale)


def snapshot_fn(flat: dict[str, jax.Array], dtype: Any):
    """A program copying the flat policy weights out of the state's buffers, cast to the serving
    `dtype` on the devices (so only the serving dtype's bytes cross to the host): into pinned host
    memory where the devices have it (the copy is then a DMA inside the program, and the publish
    only wraps host memory as numpy), else into device memory, which the host copy then reads."""
    from laminar_jax.model.precision import cast_floating
    from laminar_jax.naming import pinned_host_sharding

    pinned = {k: pinned_host_sharding(v.sharding) for k, v in flat.items()}
    if all(s is not None for s in pinned.values()):
        return jax.jit(lambda f: cast_floating(f, dtype), out_shardings=pinned)
    return jax.jit(lambda f: {k: jax.numpy.array(v, copy=True) for k, v in cast_floating(f, dtype).items()})
