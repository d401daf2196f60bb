"""Config section for the relay plane (weight store, publisher, relay workers)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect


# relay.max_unverified_bytes = 0: a run derives it as this many versions' bytes (runtime/parts.py).
UNVERIFIED_VERSIONS = 2.25
# ... and a relay started outside a run (tests, tools) with 0 takes this.
STANDALONE_UNVERIFIED_BYTES = 64 << 30


@dataclasses.dataclass(frozen=True)
class RelaySection:
    """How published weights are stored, relayed and pulled.

    Attributes:
      store_url: Versioned weight store: a tensorstore kvstore URL (file://, gs://, s3://, memory://) or a local directory. None disables the store.
      store_format: 'packed' writes a version's packed layout (the relays' byte layout) as one object per 64 MB: the fewest writes per version (a version of the demo's 20-array model costs ~3 ms of CPU to write and collect, against ~22 ms as zarr3). 'zarr3' writes one zarr3 array per weight (readable weight by weight by other zarr tools); 'zarr3_ocdbt' puts those arrays into one OCDBT database.
      keep_last: Versions the store keeps (newest first); older ones are deleted by gc() unless a reader holds a lease.
      lease_ttl_s: Default lifetime of a reader's lease on a stored version, in seconds (renew to extend).
      verify_reads: Check every array's checksum from the manifest when reading from the store.
      keep_in_memory: Complete versions each relay keeps in host memory (newest first).
      spare_buffers: Evicted version buffers a relay keeps (already faulted in) for reuse by the next versions; 0 frees them at once.
      chunk_bytes: Largest chunk a version is cut into on relay links (the pipelining unit: a relay forwards a chunk once it holds all of it). The size used for a version is chosen by the publisher (manifest.choose_chunk_bytes) from min_chunk_bytes, chunk_time_s and pipeline_chunks, never above this.
      min_chunk_bytes: Smallest chunk the publisher picks (bounds the per-chunk cost: one header and one checksum call per chunk and hop); chunk_bytes still caps it.
      chunk_time_s: On rate-limited links, longest a chunk may take to cross one link, in seconds; each extra relay in a chain adds about one chunk time to delivery.
      pipeline_chunks: A version is cut into at least about this many chunks (within min_chunk_bytes..chunk_bytes), so filling the chain's pipeline costs a small fraction of one hop.
      max_inflight_versions: Versions the publisher may hold queued (host copies) besides the one it is sending; a newer publish supersedes the oldest unsent one.
      link_rate_bytes_per_s: Token-bucket limit on every outgoing relay link (publisher -> master and relay -> successor), bytes/s; 0 = unlimited.
      link_burst_bytes: Token-bucket depth of that limiter, in bytes.
      relay_addresses: Relay chain as 'host:port' strings, master first; the publisher pushes to the first live one.
      connect_timeout_s: Timeout for opening a TCP connection to a relay.
      io_timeout_s: Longest silence tolerated on an open relay connection (a read or write that makes no progress).
      heartbeat_s: Interval of keep-alive pings on idle relay links; a dead successor is noticed within about this long plus a connect timeout.
      dead_retry_s: How long a relay that failed is skipped before a sender tries it again.
      max_chunk_retries: Rounds of re-sending chunks whose checksum failed before a link is declared bad.
      host: Interface relay servers bind to.
      base_port: TCP port of the relay server (0 = ephemeral, chosen by the OS).
      local_transport: How a rollout pulls from a relay on its own host: 'memfd' maps the relay's memory (one copy), 'tcp' streams bytes over the socket.
      gc_on_publish: Run the store's gc() after each version the publisher writes (after the version is relayed or handed off; the scan for orphaned data of killed writers on the first gc and every 32nd).
      store_check_s: With store_url set, a relay makes a pushed version pullable only once the weight store has committed that version with the same layout, waiting at most this many seconds for the commit; a version the store does not have by then (or has with another layout, or has already replaced) is dropped and counted. 0 disables the check.
      local_handoff: Local runtime only: rollout servers (all in the learner's process) take each version from the publisher's memory as soon as the weight store has committed it, and no relay runs; False runs the in-process relay and servers pull through it, as hosts of a Ray run do (what relay fault injection needs). The Ray runtime ignores it.
      handshake_timeout_s: One deadline for a new connection's whole handshake (the key exchange and its first request's header), however slowly its bytes arrive; a connection not done by then is closed.
      max_handshakes: Connections a relay holds in handshake (not yet authenticated) at once, from all addresses; a new one past it closes the connection longest in handshake (genuine handshakes take milliseconds). All handshakes run on one thread and hold at most 1 MiB (a first request's header) each.
      max_handshakes_per_source: Connections in handshake at once from one address (all unix-socket peers count as one); one past it is closed at once. Every rollout server of a host may connect at the same moment when a version lands: keep it above the servers per host.
      max_connections: Authenticated connections a relay serves at once, one thread each (rollout clients keep one per relay for version polls, and one per mapped version); one past it gets a 'busy' error and is closed.
      max_unverified_bytes: Most bytes a relay accepts as announced by unfinished pushes (all senders together) and not yet verified; a push above it is refused, so must be at least one version's size. Bounds what senders can make a relay hold. 0 (default): derived when the run starts from the model, UNVERIFIED_VERSIONS x one version's bytes in the serving dtype (a version in flight plus one a dead sender left unfinished until io_timeout_s, with a margin); a relay started outside a run with 0 takes STANDALONE_UNVERIFIED_BYTES.
    """

    store_url: Optional[str] = None
    store_format: Literal["zarr3", "zarr3_ocdbt", "packed"] = "packed"
    keep_last: int = 3
    lease_ttl_s: float = 120.0
    verify_reads: bool = True
    keep_in_memory: int = 2
    spare_buffers: int = 1
    chunk_bytes: int = 32 << 20
    min_chunk_bytes: int = 256 << 10
    chunk_time_s: float = 0.005
    pipeline_chunks: int = 64
    max_inflight_versions: int = 2
    link_rate_bytes_per_s: int = 0
    link_burst_bytes: int = 4 << 20
    relay_addresses: tuple[str, ...] = ()
    connect_timeout_s: float = 2.0
    io_timeout_s: float = 30.0
    heartbeat_s: float = 0.25
    dead_retry_s: float = 5.0
    max_chunk_retries: int = 3
    host: str = "127.0.0.1"
    base_port: int = 0
    local_transport: Literal["memfd", "tcp"] = "memfd"
    gc_on_publish: bool = True
    max_unverified_bytes: int = 0
    handshake_timeout_s: float = 10.0
    max_handshakes: int = 128
    max_handshakes_per_source: int = 32
    max_connections: int = 512
    local_handoff: bool = True
    store_check_s: float = 120.0

    def validate(self, prefix: str) -> None:
        expect(self.keep_last >= 1, f"{prefix}.keep_last", self.keep_last, ">= 1")
        expect(self.lease_ttl_s > 0, f"{prefix}.lease_ttl_s", self.lease_ttl_s, "> 0")
        expect(self.keep_in_memory >= 1, f"{prefix}.keep_in_memory", self.keep_in_memory, ">= 1")
        expect(self.spare_buffers >= 0, f"{prefix}.spare_buffers", self.spare_buffers, ">= 0")
        expect(self.chunk_bytes >= 4096, f"{prefix}.chunk_bytes", self.chunk_bytes, ">= 4096")
        expect(self.min_chunk_bytes >= 4096, f"{prefix}.min_chunk_bytes", self.min_chunk_bytes, ">= 4096")
        expect(self.chunk_time_s > 0, f"{prefix}.chunk_time_s", self.chunk_time_s, "> 0 seconds")
        expect(self.pipeline_chunks >= 1, f"{prefix}.pipeline_chunks", self.pipeline_chunks, ">= 1")
        expect(self.max_inflight_versions >= 1, f"{prefix}.max_inflight_versions",
               self.max_inflight_versions, ">= 1")
        expect(self.link_rate_bytes_per_s >= 0, f"{prefix}.link_rate_bytes_per_s",
               self.link_rate_bytes_per_s, ">= 0 (0 = unlimited)")
        expect(self.link_burst_bytes >= 4096, f"{prefix}.link_burst_bytes", self.link_burst_bytes, ">= 4096")
        for i, a in enumerate(self.relay_addresses):
            host, _, port = a.rpartition(":")
            expect(bool(host) and port.isdigit(), f"{prefix}.relay_addresses[{i}]", a, "'host:port'")
        for name in ("max_handshakes", "max_handshakes_per_source", "max_connections"):
            v = getattr(self, name)
            expect(v >= 1, f"{prefix}.{name}", v, ">= 1")
        for name in ("connect_timeout_s", "io_timeout_s", "heartbeat_s", "dead_retry_s", "handshake_timeout_s"):
            v = getattr(self, name)
            expect(v > 0, f"{prefix}.{name}", v, "> 0 seconds")
        expect(self.heartbeat_s < self.io_timeout_s, f"{prefix}.heartbeat_s", self.heartbeat_s,
               f"< io_timeout_s ({self.io_timeout_s})")
        expect(self.max_chunk_retries >= 1, f"{prefix}.max_chunk_retries", self.max_chunk_retries, ">= 1")
        expect(0 <= self.base_port < 65536, f"{prefix}.base_port", self.base_port, "in [0, 65535]")
        expect(self.max_unverified_bytes == 0 or self.max_unverified_bytes >= 4096, f"{prefix}.max_unverified_bytes",
               self.max_unverified_bytes, "0 (derived from the model) or >= 4096 (and at least one weight version's size)")
        expect(self.store_check_s >= 0, f"{prefix}.store_check_s", self.store_check_s, ">= 0 seconds (0 = off)")
        expect(bool(self.host), f"{prefix}.host", self.host, "a non-empty interface address")

    @property
    def unverified_cap(self) -> int:
        """max_unverified_bytes as a relay applies it (0, not derived by a run: the standalone cap)."""
        return self.max_unverified_bytes or STANDALONE_UNVERIFIED_BYTES
