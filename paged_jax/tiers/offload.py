"""The engine's traffic with the tiers below the pool: cached pages copied
to the host tier when the device pool evicts them, to the disk tier as soon
as they are computed, and loaded back when a prefix hit runs on into them.

Spill at eviction (write-back), to the host. A page leaves the device
prefix cache when the pool hands it out for new content
(``BlockPool.on_evict``). Its K/V are still in the pool at that moment: the
call that overwrites them has not been dispatched. :meth:`Offload.note_evicted`
only records the page; :meth:`Offload.dispatch` then copies every page
recorded since the last copy in one gather
(:func:`paged_jax.paging.swap.gather_pages`), and the KV manager calls it
before anything is dispatched that could overwrite them: at the end of a
round's plan (before its call) and before a scatter into the pool (a
swap-in, a tier load). JAX runs work on one pool in the order it was
dispatched, so the gather reads the pages as they were. The gathered batch
is split into host pages (:func:`paged_jax.tiers.host.page_copies`) at the
next dispatch or lookup, by which time the gather has run: the copy
overlaps the call after it, and the host never waits on the running batch.
vLLM's CPU offloading is write-through instead (every full block stored as
it fills, ``vllm/v1/kv_offload``): it copies every page once, whether or
not the pool would have kept it; write-back copies only what the pool lets
go, at the price of a copy on the eviction's round.

Store when computed (write-through), to disk. The disk tier is there to
outlive the process, so a page cannot wait for an eviction that may never
come: :meth:`Offload.note_cached` records every page the prefix cache takes,
and the KV manager dispatches its copy right after the call that computes
it (:meth:`paged_jax.engine.kv_manager.KVCacheManager.store_cached`); the
file is written when the copy reaches the host. A page evicted before that
is copied by the eviction's gather instead.

A page whose key a tier already holds (it was loaded from there, or spilled
before and computed again) is not copied to it again: the tier's copy is
only marked recently used. A copy holding a non-finite value (a call that
wrote NaN or inf, whose request the engine refuses when it reads the call:
:meth:`paged_jax.engine.core.Engine._refuse_poison`) is dropped, never
stored.

Load at admission. :meth:`Offload.lookup` continues a device hit into the
host tier, and the host's run into the disk tier (tokens, salt and the
parent's key checked page by page, :meth:`paged_jax.tiers.host.HostTier.lookup`).
The KV manager takes fresh pages for the run, counted in the admission's
page cost as any prefill's new pages are, and :meth:`Offload.load` scatters
the copies into them before the request's first call; the copy is
dispatched asynchronously, so on an accelerator the transfer overlaps the
call still running. The copies stay in their tiers (a second eviction costs
no copy).

Everything is counted in a :class:`TierStats` per tier.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Hashable, Sequence

import numpy as np

from paged_jax.paging.kv_cache import KVPool
from paged_jax.paging.swap import gather_pages, scatter_pages
from paged_jax.tiers.connector import ROLES, TRANSPORTS, KVConnector, KVTransferConfig, RemoteRun
from paged_jax.tiers.disk import DiskTier
from paged_jax.tiers.host import HostPage, HostTier, all_finite, page_copies, stack_pages


@dataclasses.dataclass
class TierStats:
    """What one tier served and moved, over an engine's life.

    Attributes:
      hit_tokens: prompt tokens of requests at their first admission that
        this tier served (a part of ``EngineStats.prefix_hit_tokens``).
      spilled_pages, spilled_bytes: pages (and their K/V bytes, scales
        included) copied into it (the host tier's at eviction, the disk
        tier's and a connector producer's once computed).
      loaded_pages, loaded_bytes: pages (and bytes) copied back into the
        device pool for a hit (first admissions and readmissions after a
        preemption alike).
      refused_pages: pages it did not take: larger than the whole tier,
        holding a non-finite value, or (disk) a write that failed.
      refused_files: (disk) files refused when read: short, corrupted,
        another fingerprint's, or gone (:attr:`paged_jax.tiers.disk.DiskTier.refused`
        by reason); never served.
      refused_lookups: (connector) lookups a producer refused (another
        model's), failed a check, or did not answer
        (:attr:`paged_jax.tiers.connector.KVConnector.refused` by reason).
      evicted_pages: pages it dropped, least recently used first, to make
        room.
    """

    hit_tokens: int = 0
    spilled_pages: int = 0
    spilled_bytes: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    refused_pages: int = 0
    refused_files: int = 0
    refused_lookups: int = 0
    evicted_pages: int = 0


@dataclasses.dataclass(frozen=True)
class TierRun:
    """The pages that continue a device hit: the host tier's, then the
    disk tier's, then a connector's (another engine's), in chain order."""

    host: list[HostPage] = dataclasses.field(default_factory=list)
    disk: list[HostPage] = dataclasses.field(default_factory=list)
    remote: RemoteRun = RemoteRun()

    def __len__(self) -> int:
        return len(self.host) + len(self.disk) + len(self.remote)


MEMO_RUNS = 8
"""Lookups whose runs :meth:`Offload.lookup` keeps until they are loaded."""
MAX_DISTRUSTED = 1 << 16
"""Chain keys :meth:`Offload.distrust` remembers (the oldest forgotten first)."""


@dataclasses.dataclass
class _Copy:
    page: int  # pool page id
    entry: object  # its prefix-cache entry (group, key, parent_key, tokens, extra)
    to_host: bool
    to_disk: bool
    to_remote: bool  # a connector producer's store
    after_call: bool  # computed by a call not dispatched yet when recorded: copied only after it


class Offload:
    """Copies to and from a host tier, a disk tier and a KV connector, any
    of them (module docstring). One layer group (group 0): the KV manager
    uses it for models whose layers all attend every token.

    Args:
      host: the host store, or None.
      disk: the disk store, or None.
      host_stats, disk_stats: the counters each tier adds to.
      remote: a connector (:mod:`paged_jax.tiers.connector`): a producer
        is offered every page once computed, as the disk tier is; a
        consumer is looked up after the disk tier. Or None.
      remote_stats: the connector's counters.
    """

    def __init__(self, host: HostTier | None, disk: DiskTier | None, host_stats: TierStats, disk_stats: TierStats,
                 remote: KVConnector | None = None, remote_stats: TierStats | None = None):
        self.host, self.disk, self.remote = host, disk, remote
        self.host_stats, self.disk_stats = host_stats, disk_stats
        self.remote_stats = TierStats() if remote_stats is None else remote_stats
        self._saves = remote is not None and remote.role == "producer"
        # (pool page, chain key) -> its copy, recorded, not dispatched yet: one page may hold an evicted key
        # (copied before the call that reuses it) and the key it is cached under next (copied after that call)
        self._pending: dict[tuple[int, bytes], _Copy] = {}
        self._in_transit: list[tuple[KVPool, list[_Copy]]] = []  # gathered, not stored yet
        # The last lookups' runs, by what they looked up: a request at the head of the queue is costed every round
        # until it is admitted, and its run is read (files) or fetched (another engine) once, not every round.
        self._runs: collections.OrderedDict[tuple, TierRun] = collections.OrderedDict()
        # Chain keys whose pages a connector sent and the model could not compute on (distrust): not asked again.
        self._distrusted: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    @property
    def pending_pages(self) -> int:
        """Pages recorded or being copied, not yet in their tiers."""
        return len(self._pending) + sum(len(copies) for _, copies in self._in_transit)

    def _record(self, page: int, entry, *, to_host: bool, after_call: bool) -> None:
        key = (entry.group, entry.key)
        if to_host and key in self.host:
            self.host.touch(entry.group, [entry.key])  # already there: the pool's copy needs no second one
            to_host = False
        to_disk = self.disk is not None and key not in self.disk
        to_remote = self._saves and key not in self.remote
        old = self._pending.get((page, entry.key))
        if old is not None:
            to_host, to_disk, to_remote = to_host or old.to_host, to_disk or old.to_disk, to_remote or old.to_remote
            after_call = after_call and old.after_call
        if to_host or to_disk or to_remote:
            self._pending[(page, entry.key)] = _Copy(page, entry, to_host, to_disk, to_remote, after_call)

    def note_evicted(self, page: int, entry) -> None:
        """Records that the device pool is handing out ``page``, which the
        prefix cache held as ``entry`` (its ``group``, ``key``,
        ``parent_key``, ``tokens``, ``extra``): its K/V go to the host tier
        (and to the disk tier, if it was not stored there yet), copied by
        :meth:`dispatch` before anything overwrites them (and to a
        connector producer's store, likewise)."""
        self._record(page, entry, to_host=self.host is not None, after_call=False)

    def note_cached(self, page: int, entry) -> None:
        """Records that the prefix cache took ``page`` as ``entry``, its
        K/V computed by a call dispatched or about to be: with a disk tier
        or a connector producer, they are copied there by the first
        :meth:`dispatch` with ``computed`` after that call."""
        if self.disk is not None or self._saves:
            self._record(page, entry, to_host=False, after_call=True)

    def dispatch(self, kv: KVPool, *, computed: bool = False) -> None:
        """Dispatches one copy out of ``kv`` of every page recorded as
        evicted (call it before anything that overwrites them is
        dispatched) and, with ``computed`` (call it right after a call is
        dispatched), of every page recorded as cached; the copies
        dispatched before are stored first."""
        self.settle()
        if computed and any(not c.after_call for c in self._pending.values()):
            raise RuntimeError("internal: an evicted page's copy was not dispatched before the call that reuses it")
        copies = [c for c in self._pending.values() if computed or not c.after_call]
        if copies:
            for c in copies:
                del self._pending[(c.page, c.entry.key)]
            self._in_transit.append((gather_pages(kv, [c.page for c in copies]), copies))

    def settle(self) -> None:
        """Stores the dispatched copies in their tiers (this waits for their
        gathers, not for any call after them)."""
        for copied, copies in self._in_transit:
            pages = []
            for c, kv in zip(copies, page_copies(copied, len(copies))):
                e = c.entry
                pages.append((c, HostPage(group=e.group, key=e.key, parent_key=e.parent_key, tokens=e.tokens,
                                          extra=e.extra, kv=kv), all_finite(kv)))
            for c, page, finite in pages:  # evicted pages come tail first: the host drops a chain's tail first
                if c.to_host:
                    self._store_host(page, finite)
            for c, page, finite in reversed(pages):  # cached pages come head first: stored last, the head lasts
                if c.to_disk:
                    self._store_disk(page, finite)
                if c.to_remote:
                    self._store_remote(page, finite)
        self._in_transit.clear()

    def _store_host(self, page: HostPage, finite: bool) -> None:
        st = self.host_stats
        if not finite:
            st.refused_pages += 1
            return
        out = self.host.put(page)
        if len(out) == 1 and out[0] is page:  # too big for the whole tier, or a key it holds already
            st.refused_pages += (page.group, page.key) not in self.host
            return
        st.spilled_pages += 1
        st.spilled_bytes += page.nbytes
        st.evicted_pages += len(out)

    def _store_disk(self, page: HostPage, finite: bool) -> None:
        st = self.disk_stats
        if (page.group, page.key) in self.disk:
            return
        evicted = self.disk.evicted_pages
        try:
            stored = finite and self.disk.put(page)
        except OSError:  # a full or failing disk: the tier holds less, the engine goes on
            stored = False
        st.evicted_pages += self.disk.evicted_pages - evicted
        if not stored:
            st.refused_pages += 1
            return
        st.spilled_pages += 1
        st.spilled_bytes += page.nbytes

    def _store_remote(self, page: HostPage, finite: bool) -> None:
        st = self.remote_stats
        evicted = self.remote.evicted_pages
        stored = finite and self.remote.save(page)
        st.evicted_pages += self.remote.evicted_pages - evicted
        if not stored:
            st.refused_pages += (page.group, page.key) not in self.remote
            return
        st.spilled_pages += 1
        st.spilled_bytes += page.nbytes

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, start: int,
               max_pages: int) -> TierRun:
        """The pages continuing a device hit of ``start`` pages: the host
        tier's run, then the disk tier's after it, then a connector
        consumer's (group 0). Nothing is moved into the pool until
        :meth:`load`; disk files read are verified, a connector's pages are
        fetched (into this process) and checked. The same lookup again
        (the same pages of the same chain: a request waiting to be
        admitted) returns the same run until it is loaded: pages are
        immutable under their keys, so the run stays right; it only may
        miss pages a tier gained since."""
        memo = (tuple(keys[start:max_pages]), extra, start, max_pages)
        if memo in self._runs:
            return self._runs[memo]
        self.settle()
        host = [] if self.host is None else self.host.lookup(tokens, keys, extra, start, max_pages)
        disk = []
        if self.disk is not None:
            refused = sum(self.disk.refused.values())
            disk = self.disk.lookup(tokens, keys, extra, start + len(host), max_pages)
            self.disk_stats.refused_files += sum(self.disk.refused.values()) - refused
        remote = RemoteRun()
        if self.remote is not None and self.remote.role == "consumer":
            refused = sum(self.remote.refused.values())
            first = start + len(host) + len(disk)
            stop = next((j for j in range(first, min(max_pages, len(keys))) if keys[j] in self._distrusted), max_pages)
            remote = self.remote.lookup(tokens, keys, extra, first, stop)
            self.remote_stats.refused_lookups += sum(self.remote.refused.values()) - refused
        run = TierRun(host, disk, remote)
        if len(run):
            self._runs[memo] = run
            while len(self._runs) > MEMO_RUNS:
                self._runs.popitem(last=False)
        return run

    def touch(self, keys: Sequence[bytes]) -> None:
        """A device hit on ``keys``: the host tier's copies of them, if any,
        are marked recently used (vLLM's ``OffloadingManager.touch``), so
        the head of a chain the device serves is not the first the tier
        drops."""
        if self.host is not None:
            self.host.touch(0, keys)
        if self._saves:
            self.remote.touch(keys)

    def load(self, kv: KVPool, pages: list[int], run: TierRun) -> KVPool:
        """Copies ``run``'s pages into pool pages ``pages`` (fresh ones,
        taken off the free queue; :meth:`dispatch` called after taking
        them) and marks them recently used.

        Returns:
          the new pool (``kv`` is donated).

        Raises:
          ValueError: ``pages`` and ``run`` of different lengths or empty.
        """
        if len(pages) != len(run) or not pages:
            raise ValueError(f"pages ({len(pages)}) and the run ({len(run)}) must be as many, at least one")
        self._runs = collections.OrderedDict((k, r) for k, r in self._runs.items() if r is not run)
        local = run.host + run.disk
        if local:
            kv = scatter_pages(kv, list(pages[:len(local)]), stack_pages(local))
        if run.remote:
            kv = scatter_pages(kv, list(pages[len(local):]), run.remote.kv)
            self.remote_stats.loaded_pages += len(run.remote)
            self.remote_stats.loaded_bytes += run.remote.nbytes
        for tier, found, st in ((self.host, run.host, self.host_stats), (self.disk, run.disk, self.disk_stats)):
            if found:
                tier.touch(0, [p.key for p in found])
                st.loaded_pages += len(found)
                st.loaded_bytes += sum(p.nbytes for p in found)
        return kv

    def distrust(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Pages a connector sent (pool pages ``pages``, chain keys ``keys``)
        that the model computed non-finite values on: finite numbers no
        model gives, from a producer in error (NaN and inf are refused at
        the lookup). Their copies on the way to the tiers are dropped, the
        host and disk tiers forget the keys if they stored them already,
        the connector is not asked for them again (a request recomputes
        them), and the lookup is counted as refused (``"bad pages"``)."""
        drop = set(pages)
        self._pending = {k: c for k, c in self._pending.items() if c.page not in drop}
        self._in_transit = [(kv, [dataclasses.replace(c, to_host=False, to_disk=False, to_remote=False)
                                  if c.page in drop else c for c in copies]) for kv, copies in self._in_transit]
        self._runs.clear()
        new = [key for key in keys if key not in self._distrusted]
        for key in keys:
            self._distrusted[key] = None
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.discard(0, key)
        while len(self._distrusted) > MAX_DISTRUSTED:
            self._distrusted.popitem(last=False)
        if new:  # one bad answer read by several requests is counted once
            self.remote_stats.refused_lookups += 1
            self.remote.refuse("bad pages", f"{len(drop)} pages the model computed non-finite values on")

    def clear(self) -> int:
        """Forgets every page, stored or on its way, in every tier (the disk
        tier's files of this fingerprint deleted). Returns how many the
        tiers held."""
        self._pending.clear()
        self._in_transit.clear()
        self._runs.clear()
        self._distrusted.clear()
        return sum(tier.clear() for tier in (self.host, self.disk, self.remote) if tier is not None)


GIB = 1 << 30
"""Bytes in a GiB (``--host-cache-gib``)."""
MAX_GIB = 1 << 30
"""The largest tier the flags take, GiB (an exbibyte)."""


def add_tier_flags(parser) -> None:
    """Adds the KV tiers' flags to an ``argparse.ArgumentParser`` (the
    server's and the benchmarks'): ``--host-cache-gib`` (the host tier's
    size, default 0: none), ``--disk-cache-dir`` and ``--disk-cache-gib``
    (the disk tier's folder and size); read them back with
    :func:`tier_options_from_args`."""
    group = parser.add_argument_group("KV tiers")
    group.add_argument("--host-cache-gib", type=float, default=0.0, metavar="GIB",
                       help="keep the prefix cache's evicted pages in this much host memory and load them back on "
                            "a hit (default 0: none; needs prefix caching)")
    group.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                       help="store every cached page in this folder, under the model's fingerprint, for this "
                            "process and later ones (default: none; needs --disk-cache-gib)")
    group.add_argument("--disk-cache-gib", type=float, default=0.0, metavar="GIB",
                       help="GiB of page files the disk tier keeps, least recently used deleted first")
    group.add_argument("--kv-role", choices=ROLES, default=None,
                       help="take part in KV transfer between engines (prefill/decode disaggregation): a producer "
                            "keeps every cached page for consumers at --kv-address, a consumer loads the pages the "
                            "producer there holds (default: neither)")
    group.add_argument("--kv-address", default="127.0.0.1:0", metavar="HOST:PORT",
                       help="a producer listens here (port 0: any free one, logged), a consumer connects here")
    group.add_argument("--kv-transport", choices=TRANSPORTS, default="auto",
                       help="how the K/V travel: jax.experimental.transfer, host memory, or auto (the first where "
                            "both ends have it)")
    group.add_argument("--kv-buffer-gib", type=float, default=1.0, metavar="GIB",
                       help="a producer's store of pages for consumers, least recently used out (default "
                            "%(default)s)")
    group.add_argument("--kv-timeout-s", type=float, default=30.0, metavar="S",
                       help="a consumer's wait to connect, for an answer and for a pull before it computes the "
                            "prefix itself (default %(default)s)")
    group.add_argument("--kv-authkey", default=os.environ.get("PAGED_JAX_KV_AUTHKEY"), metavar="KEY",
                       help="the key producer and consumer authenticate with (default $PAGED_JAX_KV_AUTHKEY, else "
                            "a public one that only loopback addresses accept)")


def tier_options_from_args(parser, args) -> dict:
    """The ``EngineConfig`` fields the flags of :func:`add_tier_flags` ask
    for (``host_cache_bytes``, ``disk_cache_dir``, ``disk_cache_bytes``,
    ``kv_transfer``; GiB rounded down to bytes); a bad value exits through
    ``parser.error`` naming its flag."""
    out = {}
    for flag, name in (("--host-cache-gib", "host_cache_gib"), ("--disk-cache-gib", "disk_cache_gib"),
                       ("--kv-buffer-gib", "kv_buffer_gib")):
        gib = getattr(args, name)
        if not np.isfinite(gib) or not 0 <= gib <= MAX_GIB:
            parser.error(f"{flag} must be a number in [0, {MAX_GIB}], got {gib}")
        out[name.replace("_gib", "_bytes")] = int(gib * GIB)
        if gib and not out[name.replace("_gib", "_bytes")]:
            parser.error(f"{flag} {gib} is less than one byte; pass 0 for no tier")
    if (args.disk_cache_dir is None) != (out["disk_cache_bytes"] == 0):
        parser.error("--disk-cache-dir and --disk-cache-gib go together: name the folder and the bytes it may keep")
    out["disk_cache_dir"] = args.disk_cache_dir
    buffer_bytes = out.pop("kv_buffer_bytes")
    out["kv_transfer"] = None
    if args.kv_role is None:
        given = [f"--{name.replace('_', '-')}" for name in ("kv_address", "kv_transport", "kv_buffer_gib",
                                                             "kv_timeout_s")
                 if getattr(args, name) != parser.get_default(name)]
        if given:
            parser.error(f"{', '.join(given)} without --kv-role: name the role (producer or consumer)")
    else:
        try:
            key = {} if args.kv_authkey is None else {"authkey": args.kv_authkey.encode()}
            out["kv_transfer"] = KVTransferConfig(args.kv_role, args.kv_address, args.kv_transport, buffer_bytes,
                                                  args.kv_timeout_s, **key)
        except ValueError as e:
            parser.error(f"--kv-role {args.kv_role}: {e}")
    return out
