"""The weight plane as the Driver sees it: the versioned store, the relay chain and the publisher.

The runtime starts the relays (an in-process `RelayServer`, or one `RelayActor` per Ray node) and
hands their addresses here; everything else is the same for both runtimes: the store, the
publisher, and `attach(learner)`, which connects a learner (or a multi-process learner group, whose
process 0 publishes) to the chain and makes sure its current version is published.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence


class WeightsPlane:
    def __init__(self, cfg, run_dir: str, relay_addresses: Sequence[str], stop_relays: Callable[[], None],
                 kill_master: Callable[[], str], rpc_timeout_s: float, keys, handoff=None):
        """handoff: a relay.handoff.Handoff when every rollout server runs in this process
        (relay.local_handoff): servers take versions from it, and relay_addresses may be empty."""
        from laminar_jax.relay import WeightStore
        from laminar_jax.relay.store import run_store_url

        self.cfg, self.rcfg = cfg, cfg.relay
        self.store_url = run_store_url(self.rcfg, run_dir)
        self.store = WeightStore.from_config(self.rcfg, self.store_url)
        self.relay_addresses = list(relay_addresses)
        self._stop_relays, self._kill_master = stop_relays, kill_master
        self.rpc_timeout_s = rpc_timeout_s
        # The run's keys (net/auth.py): the link key authenticates every relay message; the learner's
        # private key signs versions and stays on the learner's side (servers get keys.for_hosts()).
        self.keys = keys
        self.handoff = handoff
        self.publisher = None
        self.last_stats = None
        self.redone_steps = 0

    def client(self, holder: str, addresses: Sequence[str] = ()):
        """A relay client for one rollout server (its own node's relay first, then the others)."""
        from laminar_jax.relay import RelayClient

        client = RelayClient(list(addresses) or self.relay_addresses, store=self.store, config=self.rcfg,
                             holder=holder, keys=self.keys.for_hosts())
        if self.handoff is None:
            return client
        from laminar_jax.relay.handoff import HandoffClient

        return HandoffClient(self.handoff, client, holder)

    def attach(self, learner, initial: bool) -> None:
        """Give `learner` the publisher. `initial`: at start (or resume), make sure its current version
        is in the store and on the relays (a resumed learner's numbers after its checkpoint are
        retracted first: it publishes them again with other weights). After a restart the replayed
        version is already published; a group re-publishes only if it never reached the store."""
        from laminar_jax.learner.group import LearnerGroup

        if initial:
            # Versions the store holds beyond the restored learner were trained after its checkpoint
            # by a run that died: they are redone (and published again with their new weights).
            # From the manifests, not LATEST: a writer that died between a manifest and LATEST
            # left LATEST one behind, and that version exists all the same.
            newest = self.store.newest_committed()
            self.redone_steps = max(0, (newest or 0) - learner.version)
            self.store.retract_newer_than(learner.version)
        stored = self.store.newest_committed() == learner.version
        lora = getattr(learner, "lora", None)
        if isinstance(learner, LearnerGroup) and learner.lora_enabled:  # its processes share the base (lora_base)
            from laminar_jax.weights.lora_base import share_base

            learner.lora_base(share_base, self.rcfg, self.store_url, adopt=learner.version > 0, write=initial)
        elif lora is not None:  # the base, once, where every server reads it (weights/lora_base.py)
            from laminar_jax.weights.lora_base import adopt_base, write_base

            # Resumed: the run's base, not the one rebuilt (not checkpointed). Adopted, it is the store's
            # own, so it is not copied back to the host and hashed again to be checked against itself.
            adopted = learner.version > 0 and adopt_base(learner, self.rcfg, self.store_url)
            if initial and not adopted:
                write_base(self.rcfg, self.store_url, lora.base(), lora.base_id)
        if isinstance(learner, LearnerGroup):  # process 0 publishes; weights skip this process
            if self.handoff is not None:
                raise ValueError("relay.local_handoff: a learner group publishes from its own process; "
                                 "its versions cannot be handed off in this one")
            learner.attach_publisher(functools.partial(group_publisher, self.rcfg, self.store_url,
                                                       self.relay_addresses, self.keys))
            if initial or not stored:
                learner.publish_current(relays_only=stored)
            self.publisher = GroupPublisherProxy(learner)
            return
        if self.publisher is None:
            from laminar_jax.relay import Publisher

            self.publisher = Publisher(self.rcfg, store=self.store, relay_addresses=self.relay_addresses,
                                       keys=self.keys, handoff=self.handoff)
        published = getattr(learner, "published_params", learner.policy_params)  # LoRA: the adapter version
        if initial and not stored:
            self.publisher.publish(learner.version, published())
        elif initial:  # stored already (resume): put it where servers take it from (hand-off or relays)
            self._seed(learner.version, published())
        learner.publisher = self.publisher

    def _seed(self, version: int, params) -> None:
        from laminar_jax.relay import Publisher, tree_items

        if self.handoff is not None:
            self.handoff.offer(version, dict(tree_items(params)))
        if not self.relay_addresses:
            return
        seed = Publisher(self.rcfg, store=None, relay_addresses=self.relay_addresses, keys=self.keys)
        try:
            seed.publish(version, params)
            seed.flush(timeout=self.rpc_timeout_s)
        finally:
            seed.close()

    def latest_timings(self) -> dict:
        """The newest fully published version's timings in seconds (learner stall, store and relay
        visibility after publish), for TensorBoard; {} before the first. Read every step, so only
        from a publisher in this process: a learner group's stay in its process 0 (no call per step)."""
        from laminar_jax.relay import Publisher

        st = self.publisher.stats() if isinstance(self.publisher, Publisher) else None
        last = "relay_visible" if self.relay_addresses else "store_visible"  # a hand-off follows the store
        done = {v: t for v, t in (st.timings.items() if st is not None else ()) if last in t}
        return {f"{k}_s": float(v) for k, v in done[max(done)].items()} if done else {}

    def path(self) -> dict:
        """How versions reached the servers, for the summary: the in-memory hand-off (and how many
        versions it took) or the relays."""
        if self.handoff is None:
            return {"path": "relay", "relays": len(self.relay_addresses)}
        return {"path": "handoff", "versions_handed_off": self.handoff.offered,
                "placements": self.handoff.placements}

    def publisher_stats(self):
        try:
            return self.publisher.stats() if self.publisher is not None else None
        except Exception:  # noqa: BLE001 - diagnostics only
            return None

    def inject_failure(self) -> str:
        """Fault injection: the master relay dies; the publisher and clients go on without it."""
        return self._kill_master()

    def close(self) -> None:
        self.last_stats = self.publisher_stats()  # for the summary, after the publisher is gone
        try:
            if self.publisher is not None:
                self.publisher.close()
        finally:
            self._stop_relays()


def group_publisher(rcfg, store_url: Optional[str], relay_addresses: Sequence[str], keys,
                    with_store: bool):
    """Process 0 of a learner group's publisher, built in that process (LearnerProcess.attach_publisher):
    to the weight store and the relays, or (with_store=False) to the relays only."""
    from laminar_jax.relay import Publisher, WeightStore

    store = WeightStore.from_config(rcfg, store_url) if store_url and with_store else None
    return Publisher(rcfg, store=store, relay_addresses=list(relay_addresses), keys=keys)


class GroupPublisherProxy:
    """What the weight plane holds as `publisher` when process 0 of a group publishes."""

    def __init__(self, group):
        self.group = group

    def stats(self):
        from laminar_jax.relay.publisher import PublisherStats

        d = self.group.publisher_stats()
        if d is None:
            return None
        d["relay_failures"] = tuple(d["relay_failures"])
        return PublisherStats(**d)

    def close(self, timeout: float = 60.0) -> None:
        self.group.close_publisher(timeout)
