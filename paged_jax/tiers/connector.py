"""The KV connector: prefix-cache pages handed between engines by chain key,
for prefill/decode disaggregation (one engine process prefills, another
loads the pages and decodes) or any engine reusing another's prefixes.

Roles. A *producer* saves every page its prefix cache takes (write-through,
as the disk tier: the page's copy is gathered right after the call that
computes it, :mod:`paged_jax.tiers.offload`) into a bounded store in its
host memory (a :class:`paged_jax.tiers.host.HostTier`, least recently used
out by bytes), and answers lookups from consumers on a socket. A *consumer*
continues a prefix hit past its own device pool, host and disk tiers into
the producer's store: it sends the request's tokens, page keys and extra
key (the ``cache_salt``), the producer answers with the run of pages it
holds, each verified as the host tier verifies one (its tokens, extra key
and parent's key), and the consumer loads them into fresh pages before the
request's first call. vLLM's KV connector splits the same work into a
scheduler side (``get_num_new_matched_tokens``) and a worker side
(``start_load_kv``, ``save_kv_layer``); here one process runs both, so a
lookup returns the pages themselves.

Transports. Lookups and their answers go over a socket in
``multiprocessing.connection``'s wire format, authenticated with a shared key
(HMAC challenge) and bound to the loopback address by default, as frames
of a JSON header and the K/V's raw bytes
(:func:`paged_jax.tiers.disk.pack_frame`, a page file's own format), never
pickles: a message, even from a peer holding the key, runs no code. The K/V
travel either on the same socket as NumPy arrays (``"host"``: through host
memory, works on every platform) or through ``jax.experimental.transfer``
(``"jax_transfer"``: the producer stages the run on its device and awaits
one pull under a fresh id, the consumer pulls it into its own device
memory; the path SGLang-JAX uses between engines, over DCN on TPU).
``"auto"`` takes ``jax_transfer`` when both ends can start a transfer
server and ``host`` otherwise.

Safety. Every lookup carries the consumer's model fingerprint
(:func:`paged_jax.tiers.disk.kv_fingerprint`: the weights, the model's class
and configuration, the page size and the K/V layout); a producer whose
fingerprint differs refuses it with the reason, so another model's or
another dtype's K/V are never served. The consumer checks what comes back
too (the keys it asked for, the shapes and dtypes of its own pool). A
producer that is unreachable, slow, gone, or stops half way through a
message costs the consumer its hits, never its requests: every read and
write has a deadline (``timeout_s``), the lookup returns nothing and is
counted. Pages that pass the checks yet break the forward (finite numbers
no model gives) cost their hit too: a group that reads a connector's pages
and computes a non-finite value is recomputed without them
(:meth:`paged_jax.engine.core.Engine._recompute_bad_remote`).

Asynchrony. A save is a host-side store of a copy that
:mod:`paged_jax.tiers.offload` gathered asynchronously; the producer's
socket threads serve consumers beside its engine loop. A consumer's lookup
blocks its engine thread for one round trip per admission whose prefix
ran past its own tiers (about a millisecond on loopback, plus the K/V).
"""

from __future__ import annotations

import abc
import atexit
import collections
import dataclasses
import datetime
import itertools
import numbers
import secrets
import socket
import threading
import time
import warnings
import weakref
from multiprocessing import AuthenticationError
from typing import Hashable, Sequence

import jax
import numpy as np

from paged_jax.checks import check_int
from paged_jax.paging.kv_cache import KVPool
from paged_jax.tiers.disk import FRAME_ERRORS, KV_FIELDS, encode_extra, pack_frame, page_layout, unpack_frame
from paged_jax.tiers.host import HostPage, HostTier, all_finite, stack_pages
from paged_jax.tiers.link import Link, ready_within, start_transfer_server

ROLES = ("producer", "consumer")
"""A connector's roles: a producer saves pages and serves them, a consumer looks them up and loads them."""
TRANSPORTS = ("auto", "jax_transfer", "host")
"""How the K/V travel (module docstring)."""
DEFAULT_AUTHKEY = b"paged-jax-kv"
"""The key both ends use unless told (public: loopback addresses only)."""
LOOPBACK = ("127.0.0.1", "localhost")
"""Hosts the default key may be used on."""
PROTOCOL = 2
"""The message format's version; a peer of another version is refused.
Messages are :func:`paged_jax.tiers.disk.pack_frame` frames (a JSON header,
then the K/V's raw bytes): reading one runs no code, unlike a pickle."""
MAX_MESSAGE_BYTES = (1 << 31) - 1
"""The largest reply a consumer reads (2 GiB less a byte, the longest
length multiprocessing's four-byte header gives); a producer serves no
longer run than fits in one, and a longer reply ends the connection."""
MAX_REQUEST_BYTES = 1 << 28
"""The largest lookup a producer reads (256 MiB: a prompt of millions of
tokens, with its keys); a longer one ends the connection."""
MAX_HANDSHAKES = 64
"""Connections a producer keeps that have not authenticated yet; a newer
one drops the oldest."""
HANDSHAKE_S = 5.0
"""A producer drops a connection that has not authenticated in this many
seconds (or ``timeout_s``, if shorter)."""
CLOSE_WAIT_S = 5.0
"""``KVProducer.close`` waits this long at most (and at most ``timeout_s``)
for the threads serving consumers to end."""
"""A reader grows its buffer by at most this many bytes a read."""
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 86_400.0
"""The shortest and longest ``KVTransferConfig.timeout_s``: a millisecond, a day."""
RETRY_S = 5.0
"""After a lookup could not reach the producer, a consumer tries again no
sooner than this many seconds (at most ``timeout_s``) later, the wait
doubling while the producer stays unreachable; the lookups between find
nothing, at no cost to the engine."""
MAX_RETRY_S = 60.0
"""The longest wait between tries at an unreachable producer, seconds."""


def parse_address(name: str, address: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``.

    Raises:
      ValueError: not a string of that form, or the port not in [0, 65535].
    """
    if not isinstance(address, str) or address.count(":") != 1:
        raise ValueError(f"{name}={address!r}: expected 'host:port', e.g. '127.0.0.1:8470' (IPv4 or a name)")
    host, _, port = address.partition(":")
    if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"{name}={address!r}: expected a host name and a port in [0, 65535]")
    try:
        if not host.isprintable() or " " in host:
            raise UnicodeError("a blank or unprintable character")
        host.encode("idna")
    except UnicodeError as e:
        raise ValueError(f"{name}={address!r}: {host!r} is not a host name ({e})") from None
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """How an engine takes part in KV transfer (``EngineConfig.kv_transfer``;
    the server's ``--kv-role`` and friends).

    Attributes:
      role: ``"producer"`` (saves every cached page and serves them) or
        ``"consumer"`` (loads pages a producer holds).
      address: ``"host:port"``: a producer listens there (port 0: a free
        one, read back from the connector's ``address``); a consumer
        connects there.
      transport: ``"auto"``, ``"jax_transfer"`` or ``"host"`` (module
        docstring); a producer offers what it names, a consumer asks for
        it.
      buffer_bytes: a producer's store for consumers, bytes of K/V (least
        recently used out); unused by a consumer.
      timeout_s: seconds one lookup of a consumer may take, connecting,
        round trip and pull together, before it gives up (at most a day);
        after a producer could not be reached it is tried again
        :data:`RETRY_S` seconds later at the soonest, the wait doubling while
        it stays unreachable (up to :data:`MAX_RETRY_S`); a producer's
        limit for each step of serving a consumer.
      authkey: the shared key both ends authenticate with (the server's
        ``--kv-authkey``, default ``$PAGED_JAX_KV_AUTHKEY``). The default,
        :data:`DEFAULT_AUTHKEY`, is public: it is refused for an address
        other than the loopback one.

    Raises:
      ValueError: a field out of range, named with its value.
    """

    role: str
    address: str = "127.0.0.1:0"
    transport: str = "auto"
    buffer_bytes: int = 1 << 30
    timeout_s: float = 30.0
    authkey: bytes = DEFAULT_AUTHKEY

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"kv_transfer.role={self.role!r}: expected one of {ROLES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv_transfer.transport={self.transport!r}: expected one of {TRANSPORTS}")
        _, port = parse_address("kv_transfer.address", self.address)
        if self.role == "consumer" and port == 0:
            raise ValueError(f"kv_transfer.address={self.address!r}: a consumer needs the producer's port, not 0")
        object.__setattr__(self, "buffer_bytes", check_int("kv_transfer.buffer_bytes", self.buffer_bytes, 0))
        if self.role == "producer" and not self.buffer_bytes:
            raise ValueError("kv_transfer.buffer_bytes=0: a producer needs room for the pages it serves")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, numbers.Real)
                or not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"kv_transfer.timeout_s={self.timeout_s!r}: expected seconds in [{MIN_TIMEOUT_S}, "
                             f"{MAX_TIMEOUT_S}]")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        if not isinstance(self.authkey, bytes) or not self.authkey:
            raise ValueError(f"kv_transfer.authkey={self.authkey!r}: expected non-empty bytes")
        host, _ = parse_address("kv_transfer.address", self.address)
        if self.authkey == DEFAULT_AUTHKEY and host not in LOOPBACK:
            raise ValueError(f"kv_transfer.address={self.address!r} is not a loopback address and "
                             "kv_transfer.authkey is the public default: pass a key of your own (the server's "
                             "--kv-authkey or $PAGED_JAX_KV_AUTHKEY), the same at both ends")


@dataclasses.dataclass(frozen=True)
class RemoteRun:
    """Pages a consumer fetched: their chain keys in order, their K/V
    stacked (page axis 2, :func:`paged_jax.paging.swap.scatter_pages`'s
    ``copied``; the first ``len(keys)`` of a power of two over
    ``jax_transfer``), on the device (``jax_transfer``) or in NumPy
    (``host``), and the bytes of those pages."""

    keys: tuple[bytes, ...] = ()
    kv: KVPool | None = None
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.keys)


def _layout_json(layout: dict) -> dict:
    """A page layout as it reads back from JSON: ``{field: [dtype, [shape]]}``."""
    return {f: [dtype, list(shape)] for f, (dtype, shape) in layout.items()}


def _pow2(n: int) -> int:
    """The least power of two >= ``n`` (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _close_at_exit(ref) -> None:
    connector = ref()
    if connector is not None:
        connector.close()


class KVConnector(abc.ABC):
    """What the engine asks of a connector (:mod:`paged_jax.tiers.offload`
    calls it beside the host and disk tiers). One layer group (0).

    Attributes:
      role: ``"producer"`` or ``"consumer"``.
      transport: the transport in use (``"jax_transfer"`` or ``"host"``).
      fingerprint: the model fingerprint its pages are kept under.
      capacity_bytes, used_bytes: the bytes of pages it may keep and
        keeps (a producer's store; 0 for a consumer).
      refused: lookups that brought nothing, by reason (a consumer:
        ``"fingerprint"`` another model, ``"unreachable"`` not reached or
        timed out, ``"bad answer"`` it failed a check, ``"bad pages"`` its
        pages broke the first call on them and were recomputed).

    A consumer also counts ``lookups`` and ``lookup_s`` (seconds in them,
    round trips and pulls included); a producer ``served_pages`` and
    ``served_bytes``.
    """

    role: str
    transport: str
    fingerprint: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    evicted_pages: int = 0

    def __init__(self):
        self.refused: dict[str, int] = {}

    @abc.abstractmethod
    def __contains__(self, group_key: tuple[int, bytes]) -> bool:
        """Whether the connector already holds a page (a producer's store)."""

    @abc.abstractmethod
    def save(self, page: HostPage) -> bool:
        """Offers a computed page to consumers; whether it was kept."""

    @abc.abstractmethod
    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, start: int,
               max_pages: int) -> RemoteRun:
        """The run of pages ``start, start + 1, ...`` (before ``max_pages``)
        a producer holds for these tokens, fetched and verified."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks pages of ``keys`` recently used where they are kept."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Forgets every page kept here; returns how many."""

    def set_fingerprint(self, fingerprint: str) -> None:
        """New weights: pages are kept and asked for under ``fingerprint``
        from now on (call :meth:`clear` too)."""
        self.fingerprint = fingerprint

    def close(self) -> None:
        """Stops serving or drops the connection."""


def _check_role(config, role: str) -> None:
    """Raises ValueError unless ``config`` is a :class:`KVTransferConfig` of ``role``."""
    if not isinstance(config, KVTransferConfig) or config.role != role:
        raise ValueError(f"config must be a KVTransferConfig of role {role!r}, got "
                         f"{getattr(config, 'role', type(config).__name__)!r}")


class KVProducer(KVConnector):
    """Saves pages into a bounded host store and serves them to consumers
    (module docstring).

    Args:
      config: its :class:`KVTransferConfig` (role ``"producer"``).
      fingerprint: the engine's model fingerprint.
      layout: one page's leaves, :func:`paged_jax.tiers.disk.page_layout`.
      page_size: tokens per page.

    Raises:
      ValueError: a ``config`` not of role ``"producer"``, a buffer below
        one page, the address cannot be listened on (named, with the OS's
        reason), or ``transport="jax_transfer"`` where no transfer server
        starts.
    """

    role = "producer"

    def __init__(self, config: KVTransferConfig, fingerprint: str, layout: dict, page_size: int):
        super().__init__()
        _check_role(config, "producer")
        page_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for dtype, shape in layout.values())
        if config.buffer_bytes < page_bytes:
            raise ValueError(f"kv_transfer.buffer_bytes={config.buffer_bytes} is below one page's "
                             f"{page_bytes} bytes of K/V: the producer could serve nothing")
        self.config, self.fingerprint, self.layout = config, fingerprint, layout
        self._store = HostTier(config.buffer_bytes, page_size)
        self._lock = threading.Lock()  # the store, shared by the engine thread and the socket threads
        host, port = parse_address("kv_transfer.address", config.address)
        try:
            self._server = socket.create_server((host, port))
        except (OSError, ValueError, TypeError) as e:  # UnicodeError is a ValueError
            raise ValueError(f"kv_transfer.address={config.address!r} cannot be listened on: {e}") from None
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._transfer = None if config.transport == "host" else start_transfer_server(host)
        if self._transfer is None and config.transport == "jax_transfer":
            self._server.close()
            raise ValueError("kv_transfer.transport='jax_transfer': no jax.experimental.transfer server starts "
                             "on this platform; use 'auto' or 'host'")
        self.transport = "host" if self._transfer is None else "jax_transfer"
        self.served_pages = 0  # pages sent to consumers
        self.served_bytes = 0
        self._closed = False
        self._links: set[Link] = set()  # consumers connected
        self._threads: set[threading.Thread] = set()  # serving consumers; close() waits for them
        self._handshaking: collections.OrderedDict[Link, None] = collections.OrderedDict()  # not authenticated yet
        self._acceptor = threading.Thread(target=self._accept, name="kv-producer", daemon=True)
        self._acceptor.start()
        atexit.register(_close_at_exit, weakref.ref(self))  # never serving while the interpreter shuts down

    @property
    def capacity_bytes(self) -> int:
        return self._store.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._store.used_bytes

    @property
    def evicted_pages(self) -> int:
        return self._store.evicted_pages

    def __contains__(self, group_key: tuple[int, bytes]) -> bool:
        with self._lock:
            return group_key in self._store

    def save(self, page: HostPage) -> bool:
        with self._lock:
            out = self._store.put(page)
        return not (len(out) == 1 and out[0] is page)

    def lookup(self, tokens, keys, extra, start, max_pages) -> RemoteRun:
        return RemoteRun()  # a producer serves; it does not fetch

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._store.touch(0, keys)

    def clear(self) -> int:
        with self._lock:
            return self._store.clear()

    def close(self) -> None:
        """Stops serving: the listener and every consumer's connection
        closed (their lookups then find nothing)."""
        if self._closed:
            return
        self._closed = True
        try:  # wakes the accepting thread, which sees it is closed
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        with self._lock:
            links, self._links = self._links, set()
        for link in links:
            link.close()
        # Each serving thread ends once its link is closed (a stage or pull in progress first): waited for, so that
        # none is inside JAX when the interpreter shuts down (which aborts the process).
        deadline = time.monotonic() + min(self.config.timeout_s, CLOSE_WAIT_S)
        with self._lock:
            threads = list(self._threads)
        for thread in [self._acceptor, *threads]:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:  # closed, or a failure of one client's: keep serving the others
                if not self._closed:
                    time.sleep(0.01)
                continue
            try:
                link = Link(sock)
            except OSError:  # no descriptor left for it: this client is dropped, the others served
                sock.close()
                time.sleep(0.01)
                continue
            with self._lock:
                if self._closed:
                    link.close()
                    return
                self._links.add(link)
                self._handshaking[link] = None
                # Connections that have not authenticated yet hold descriptors: past MAX_HANDSHAKES the oldest is
                # dropped, so a flood of silent ones turns over instead of locking consumers out.
                excess = len(self._handshaking) - MAX_HANDSHAKES
                stale = [self._handshaking.popitem(last=False)[0] for _ in range(excess)]
            for old in stale:
                old.close()
            # The handshake in the connection's own thread: a client that says nothing delays nobody else.
            thread = threading.Thread(target=self._serve, args=(link,), name="kv-producer-conn", daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, link: Link) -> None:
        try:
            try:
                link.handshake(self.config.authkey, min(self.config.timeout_s, HANDSHAKE_S), server=True)
            except BaseException:  # another key, a silent or gone client: dropped
                return
            finally:
                with self._lock:
                    self._handshaking.pop(link, None)
            while True:
                try:
                    data = link.next_message(MAX_REQUEST_BYTES, self.config.timeout_s)
                except Exception:  # the consumer left, sent too much, or close() closed the connection under us
                    return
                try:
                    reply, kv = self._answer(unpack_frame(data)[0])
                except Exception as e:  # a malformed request: answered, the producer goes on
                    reply, kv = {"refused": "bad request", "detail": f"{type(e).__name__}: {e}"}, None
                try:
                    link.within(self.config.timeout_s).send_bytes(pack_frame(reply, kv))
                except OSError:  # a TimeoutError too: a consumer that stopped reading
                    return
        finally:
            with self._lock:
                self._links.discard(link)
                self._threads.discard(threading.current_thread())
            link.close()

    def _answer(self, msg: dict) -> tuple[dict, KVPool | None]:
        """The reply to one message (a :func:`paged_jax.tiers.disk.pack_frame`
        header), and the K/V it carries."""
        if msg.get("protocol") != PROTOCOL:
            return {"refused": "protocol",
                    "detail": f"producer speaks protocol {PROTOCOL}, got {msg.get('protocol')!r}"}, None
        if msg["op"] == "hello":
            return {"transport": self.transport,
                    "transfer_address": None if self._transfer is None else self._transfer.address()}, None
        layout = _layout_json(self.layout)
        if msg["fingerprint"] != self.fingerprint or msg["layout"] != layout:
            return {"refused": "fingerprint",
                    "detail": f"the producer serves model {self.fingerprint[:16]} with pages {layout}; this "
                              f"lookup is for {str(msg['fingerprint'])[:16]} with {msg['layout']}"}, None
        keys = [bytes.fromhex(k) for k in msg["keys"]]
        if not all(isinstance(t, int) for t in msg["tokens"]):
            raise TypeError("tokens must be ints")
        with self._lock:
            pages = self._store.lookup(msg["tokens"], keys, tuple(msg["extra"]), msg["start"], msg["max_pages"])
            self._store.touch(0, [p.key for p in pages])
        pull = msg["transport"] == "jax_transfer" and self._transfer is not None
        uuid = int(msg["uuid"]) if pull else 0
        if not pull:  # the K/V travel in the reply: no longer run than one message holds (the rest is computed)
            room = MAX_MESSAGE_BYTES - (1 << 20) - 80 * len(pages)  # the header's keys and layout, generously
            fits = next((i for i, total in enumerate(itertools.accumulate(p.nbytes for p in pages)) if total > room),
                        len(pages))
            pages = pages[:fits]
        if not pages:
            return {"keys": []}, None
        stacked = stack_pages(pages)
        self.served_pages += len(pages)
        self.served_bytes += sum(p.nbytes for p in pages)
        out = {"keys": [p.key.hex() for p in pages], "layout": _layout_json(self.layout)}
        if pull:
            # A power of two of pages (zeros past the run), as paged_jax.paging.swap pads every copy: the
            # consumer's scatter then runs one of a handful of programs, never an op compiled per run length.
            n = _pow2(len(pages))
            stacked = jax.tree.map(lambda x: np.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2])] + [(0, 0)] * (x.ndim - 3)),
                                   stacked)
            self._transfer.await_pull(uuid, jax.device_put(stacked))
            return out, None
        return out, stacked


class KVConsumer(KVConnector):
    """Looks pages up in a producer's store and fetches them (module
    docstring).

    Args:
      config: its :class:`KVTransferConfig` (role ``"consumer"``).
      fingerprint: the engine's model fingerprint.
      layout: one page's leaves, :func:`paged_jax.tiers.disk.page_layout`.
      page_size: tokens per page.

    Raises:
      ValueError: no producer answers at ``config.address`` within
        ``timeout_s``, or it refuses (another protocol), or
        ``transport="jax_transfer"`` and either end has no transfer server.
    """

    role = "consumer"

    def __init__(self, config: KVTransferConfig, fingerprint: str, layout: dict, page_size: int):
        super().__init__()
        _check_role(config, "consumer")
        self.lookups = 0  # lookups sent
        self.lookup_s = 0.0  # seconds spent in them, round trips and pulls included
        self.config, self.fingerprint, self.layout, self.page_size = config, fingerprint, layout, page_size
        self._address = parse_address("kv_transfer.address", config.address)
        self._link: Link | None = None
        self._closed = False
        self._retry_at = 0.0  # time.monotonic() before which a lost producer is not tried again
        self._failures = 0  # lookups in a row that could not reach the producer (the retry wait doubles)
        self._deadline = 0.0  # time.monotonic() by which the current lookup (or the first hello) must end
        self._pull = None  # a jax.experimental.transfer connection to the producer's server
        self._transfer = None  # this process's transfer server, started on the interface that reaches the producer
        self._transfer_tried = config.transport == "host"
        try:
            self._deadline = time.monotonic() + config.timeout_s
            hello = self._connect()
        except AuthenticationError as e:
            self._drop()
            raise ValueError(f"kv_transfer.authkey: the KV producer at {config.address!r} holds another key "
                             f"({e}); give both ends the same --kv-authkey / $PAGED_JAX_KV_AUTHKEY") from None
        except (OSError, EOFError, TimeoutError, ValueError, TypeError) as e:
            self._drop()
            raise ValueError(f"kv_transfer.address={config.address!r}: no KV producer answers there "
                             f"({type(e).__name__}: {e}); a producer opens its port once its model is "
                             "loaded") from None
        if "refused" in hello:
            self._drop()
            raise ValueError(f"kv_transfer.address={config.address!r}: the producer refused: {hello.get('detail')}")
        if config.transport == "jax_transfer" and self.transport != "jax_transfer":
            self._drop()
            raise ValueError(f"kv_transfer.transport='jax_transfer': the producer at {config.address} or this "
                             "process has no jax.experimental.transfer server; use 'auto' or 'host'")

    def _connect(self) -> dict:
        """Connects (again), within ``timeout_s``, and says hello; returns the
        producer's answer."""
        self._drop()
        link = Link(socket.create_connection(self._address, timeout=self._left()))
        if not self._transfer_tried:
            self._transfer_tried = True
            self._transfer = start_transfer_server(link.sock.getsockname()[0])
        link.handshake(self.config.authkey, self._left(), server=False)
        self._link = link
        hello, _ = self._exchange(link, {"protocol": PROTOCOL, "op": "hello"})
        addr = hello.get("transfer_address")
        if addr is not None and not isinstance(addr, str):
            raise ValueError(f"a hello whose transfer_address is {addr!r}")
        host, _, port = (addr or "").rpartition(":")
        if host in ("0.0.0.0", "[::]", "::"):  # a producer listening on every interface: reached where we dialled
            addr = f"{self._address[0]}:{port}"
        self.transport = "host"
        if "refused" not in hello and addr is not None and self._transfer is not None:
            try:
                self._pull = self._transfer.connect(addr)  # returns at once: the connection is made by a pull
            except Exception as e:  # JAX's runtime error for an address it cannot use
                raise ValueError(f"a hello whose transfer_address {addr!r} cannot be connected to: {e}") from None
            self.transport = "jax_transfer"
        return hello

    def _left(self) -> float:
        """Seconds left of the current lookup's ``timeout_s``: connecting,
        the handshake, the round trip and the pull share it.

        Raises:
          TimeoutError: none left."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the lookup took its timeout_s={self.config.timeout_s} s")
        return left

    def _unreachable(self) -> None:
        """After a lookup that could not reach the producer: no lookup tries
        again for :data:`RETRY_S` (at most ``timeout_s``), the wait doubling
        while it stays unreachable, up to :data:`MAX_RETRY_S`; the lookups
        between find nothing at no cost."""
        self._failures += 1
        first = min(RETRY_S, self.config.timeout_s)
        self._retry_at = time.monotonic() + min(first * 2 ** min(self._failures - 1, 16), MAX_RETRY_S)

    def _exchange(self, link: Link, msg: dict) -> tuple[dict, KVPool | None]:
        """Sends ``msg`` and reads the producer's reply, header and K/V, all
        of it within what is left of the lookup's ``timeout_s``.

        Raises:
          TimeoutError: not done within ``timeout_s`` (a producer that is
            silent, or stops half way through its reply).
          OSError, EOFError: the connection failed.
          ValueError: the reply is not a frame (:data:`paged_jax.tiers.disk.FRAME_ERRORS`
            become ValueError).
        """
        link.within(self._left())
        link.send_bytes(pack_frame(msg))
        data = link.recv_bytes(MAX_MESSAGE_BYTES)
        link.deadline = None
        try:
            return unpack_frame(data)
        except FRAME_ERRORS as e:
            raise ValueError(f"a reply that is not a frame ({type(e).__name__}: {e})") from None

    def _drop(self) -> None:
        if self._link is not None:
            self._link.close()
        self._link = self._pull = None

    def __contains__(self, group_key: tuple[int, bytes]) -> bool:
        return False

    def save(self, page: HostPage) -> bool:
        return False  # a consumer keeps nothing for others

    def clear(self) -> int:
        return 0

    def close(self) -> None:
        """Drops the connection; no lookup is sent from now on."""
        self._closed = True
        self._drop()

    def refuse(self, reason: str, detail: str) -> RemoteRun:
        """Counts a lookup that brought nothing under ``reason`` (warned the
        first time); returns the empty run."""
        first = reason not in self.refused
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if first:
            warnings.warn(f"KV connector: a lookup at {self.config.address} brought nothing ({reason}: {detail}); "
                          "those prefixes are computed here", stacklevel=3)
        return RemoteRun()

    def lookup(self, tokens, keys, extra, start, max_pages) -> RemoteRun:
        """The run of pages a producer holds from page ``start`` on (before
        ``max_pages``), fetched into this process and checked (keys, shapes,
        dtypes); an empty run when it holds none, refuses, fails a check or
        does not answer within ``timeout_s`` (counted in :attr:`refused`)."""
        if start >= min(max_pages, len(keys)) or self._closed:
            return RemoteRun()
        t0 = time.perf_counter()
        try:
            return self._lookup(tokens, keys, extra, start, max_pages)
        finally:
            self.lookups += 1
            self.lookup_s += time.perf_counter() - t0

    def _lookup(self, tokens, keys, extra, start, max_pages) -> RemoteRun:
        encoded = encode_extra(extra)
        if encoded is None:  # a salt that is not str / int / None: not sent, never hit
            return RemoteRun()
        uuid = secrets.randbits(62) + 1
        msg = {"protocol": PROTOCOL, "op": "lookup", "fingerprint": self.fingerprint,
               "layout": _layout_json(self.layout), "tokens": [int(t) for t in tokens],
               "keys": [k.hex() for k in keys], "extra": encoded, "start": start, "max_pages": max_pages,
               "transport": self.transport, "uuid": uuid}
        if self._link is None and time.monotonic() < self._retry_at:
            return self.refuse("unreachable", "waiting to connect again")
        self._deadline = time.monotonic() + self.config.timeout_s
        try:
            if self._link is None:
                self._connect()
            reply, kv = self._exchange(self._link, msg)
        except (ValueError, TypeError) as e:  # an answer that is not one: the connection is out of step, made again
            self._drop()
            return self.refuse("bad answer", f"{type(e).__name__}: {e}")
        except (OSError, EOFError, TimeoutError, AuthenticationError) as e:
            self._drop()  # connect again at a later lookup (_unreachable)
            self._unreachable()
            why = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__}: the producer closed the connection"
            return self.refuse("unreachable", why)
        self._failures = 0  # it answered
        if "refused" in reply:
            return self.refuse(str(reply["refused"]), str(reply.get("detail")))
        try:
            got = tuple(bytes.fromhex(k) for k in reply["keys"])
        except (KeyError, TypeError, ValueError):
            return self.refuse("bad answer", f"a reply without page keys: {str(reply)[:200]}")
        if not got:
            return RemoteRun()
        if got != tuple(keys[start:start + len(got)]) or start + len(got) > max_pages:
            return self.refuse("bad answer", f"pages {start}.. came back under other keys")
        n = len(got)
        if kv is None and self._pull is None:
            return self.refuse("bad answer", f"{n} page keys without their K/V")
        if kv is None:
            if reply.get("layout") != _layout_json(self.layout):  # a pull takes our shapes: the producer's word
                return self.refuse("bad answer", f"a run to pull staged as {reply.get('layout')}, expected "
                                                 f"{_layout_json(self.layout)}")
            n = _pow2(n)  # padded by the producer
            shapes = {f: (dtype, shape[:2] + (n,) + shape[3:]) for f, (dtype, shape) in self.layout.items()}
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            structs = KVPool(**{f: jax.ShapeDtypeStruct(shapes[f][1], np.dtype(shapes[f][0]), sharding=sharding)
                                if f in shapes else None for f in KV_FIELDS})  # a latent pool has no V
            budget = self._left()
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=budget)
            try:
                kv = ready_within(self._pull.pull(uuid, structs, timeout=deadline), budget)
            except Exception as e:  # the pull timed out or failed: the arrays hold its error
                self._drop()
                self._unreachable()
                return self.refuse("unreachable", f"pull failed: {type(e).__name__}: {e}")
        have = page_layout(kv) if isinstance(kv, KVPool) else None
        if have != self.layout or {x.shape[2] for x in jax.tree.leaves(kv)} != {n}:
            return self.refuse("bad answer", f"{n} pages of layout {have}, expected {self.layout}")
        if not all_finite(kv):  # never loaded: the request would fail on them (a producer checks what it saves)
            return self.refuse("bad answer", "pages holding NaN or inf")
        return RemoteRun(got, kv, len(got) * sum(x.nbytes // x.shape[2] for x in jax.tree.leaves(kv)))
