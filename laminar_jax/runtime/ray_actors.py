"""Ray actors of the rollout and relay roles, and the buffer service seen through Ray.

`RolloutActor` hosts the SAME `RolloutWorker` + `RolloutServer` as the local runtime, in a
supervised thread of its own; the worker's buffer is a `RemoteBuffer` (the buffer service's methods
as bounded calls to its actor). `RelayActor` runs one `RelayServer` (TCP, bound to `relay.host`) on
its node. The classes are plain Python; the runtime wraps them with `ray.remote`.
"""

from __future__ import annotations

import time
from typing import Optional

from laminar_jax.runtime.rollout_host import RolloutHost


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def bounded_get(ref, timeout: float, what: str):
    """ray.get, bounded; a timeout is a TimeoutError naming what was waited for."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"waited {timeout:.1f}s for {what}") from None


class RemoteBuffer:
    """The buffer service's methods as bounded calls to its Ray actor; errors name the method.

    With `name` (the buffer actor's Ray name), a call that finds the actor dead waits (bounded by
    `timeout_s`) for the driver's replacement under the same name and is made again there: a
    rollout actor keeps generating across a buffer restart. Repeating a call on the replacement is
    safe: it knows nothing of the dead buffer's work, so a late result is dropped and a take gets
    the replacement's own work."""

    def __init__(self, handle, timeout_s: float, name: Optional[str] = None):
        self.handle, self.timeout_s, self.name = handle, timeout_s, name

    def _call(self, handle, method: str, args: tuple):
        # +1 s: get_batch waits inside the actor for up to its own (short) timeout argument.
        return bounded_get(getattr(handle, method).remote(*args), self.timeout_s + 1.0,
                           f"the buffer actor's {method}()")

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args):
            import ray

            handle = self.handle
            try:
                out = self._call(handle, method, args)
            except ray.exceptions.RayActorError as e:
                handle = self._replacement(handle, method, e)
                if handle is None:
                    return None
                out = self._call(handle, method, args)
            return self._note(handle, method, args, out)

        return call

    def _replacement(self, dead, method: str, error: BaseException):
        """The live actor to make a call again on after `dead` failed it (None: the call needs no answer)."""
        if self.name is None:
            raise error
        self.handle = follow_named(self.name, dead, self.timeout_s)
        return self.handle

    def _note(self, handle, method: str, args: tuple, out):
        """What a subclass keeps from an answer as it passes; the answer the caller gets."""
        return out


def follow_named(name: str, dead, timeout_s: float):
    """The live actor now registered as `name` (not `dead`), waiting for it at most `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            handle = ray.get_actor(name)
            if handle._actor_id != dead._actor_id:
                return handle
        except ValueError:  # not registered (yet): the replacement is starting
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the buffer actor {name!r} died and no replacement registered within {timeout_s:.1f}s")
        time.sleep(0.1)


class RelayActor:
    """One relay server per node; rollout actors on that node pull from it (memfd when local)."""

    def __init__(self, cfg, keys):
        from laminar_jax.relay import RelayServer

        self.server = RelayServer(cfg.relay, keys=keys).start()

    def address(self) -> str:
        """host:port others reach it at (a wildcard bind advertises the node's IP)."""
        import ray

        host, _, port = self.server.address.rpartition(":")
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def set_successors(self, addresses: list[str]) -> None:
        self.server.set_successors(addresses)

    def stop(self) -> None:
        self.server.stop()


def actor_mesh(tp: int):
    """A rollout actor's engine mesh: its first ``tp`` local devices (the GPUs Ray gave it); None
    (the single-device path) at TP 1."""
    import jax

    if tp == 1:
        return None
    from laminar_jax.configlib import ConfigError
    from laminar_jax.rollout.tp import tp_mesh

    local = jax.local_devices()
    if len(local) < tp:
        raise ConfigError(f"placement.rollout_tp={tp}: this rollout actor sees {len(local)} device(s) ({local})")
    return tp_mesh(local[:tp])


class RolloutActor(RolloutHost):
    """One rollout server as a Ray actor (runtime/rollout_host.py): its own node's relay first, the
    buffer actor behind `RemoteBuffer`, the engine over the GPUs Ray gave it."""

    def __init__(self, cfg, index: int, generation: int, relays: dict, store_url: Optional[str], buffer,
                 rpc_timeout_s: float, keys, buffer_name: Optional[str] = None):
        from laminar_jax.process_settings import apply_process_settings

        apply_process_settings(cfg)  # before this actor's JAX starts; it inherits none of the driver's
        # Its own node's relay first (a local pull maps the relay's memory), the others after.
        here = node_id()
        addresses = [a for n, a in relays.items() if n == here] + [a for n, a in relays.items() if n != here]
        super().__init__(cfg, index, generation, addresses, store_url, RemoteBuffer(buffer, rpc_timeout_s, buffer_name),
                         keys, mesh=actor_mesh(cfg.placement.rollout_tp))

    def ready(self) -> dict:
        return {**super().ready(), "node": node_id()}
