"""The disk tier of the prefix cache: cached pages in files that outlive the
process.

A page is one file, ``<folder>/<fingerprint[:32]>/g<group>/<chain key>.kv``:
the fingerprint names what computed it (the model's weights, the page size,
the pool's K/V dtypes and shapes: :func:`kv_fingerprint`), so pages of
another model, another page size or another K/V dtype sit in another folder
and can never be served. A file holds, in order: the magic
:data:`MAGIC`, a little-endian u32 header length, a JSON header (the
fingerprint, the layer group, the chain key and its parent's, the page's
tokens and extra key, each K/V leaf's dtype and shape), the leaves' bytes,
and the SHA-256 of everything before it. A file is written under a
temporary name in its folder and renamed into place (atomic on POSIX), so a
reader sees a whole file or none; a file that is nonetheless short, whose
checksum, magic or header does not hold, or whose header names another
fingerprint or key, is refused, counted by reason (:attr:`DiskTier.refused`)
and deleted, never read as K/V. A run is found as the host tier finds it
(:meth:`paged_jax.tiers.host.HostTier.lookup`): tokens, salt and the parent's
key checked page by page.

The folder is bounded by bytes (files' sizes, headers included): the least
recently used file goes first. Recency is the file's modification time, so a
second process opening the folder orders it as the first left it; a hit
refreshes it. Engines and processes may share a folder: a lookup also finds
a file another one wrote after this one opened the folder (and verifies it
as any other), and each keeps its own bound over the files it knows.

Reads and writes are synchronous, on the engine's thread: a page's file is
written when its copy reaches the host (:mod:`paged_jax.tiers.offload`),
and read when an admission's hit runs into it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import stat
import struct
import tempfile
from typing import Hashable, Sequence

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 and the fp8 dtypes with NumPy by name)
import numpy as np

from paged_jax.checks import check_int
from paged_jax.paging.kv_cache import KVPool
from paged_jax.paging.prefix_cache import holds_page
from paged_jax.tiers.host import HostPage

MAGIC = b"PJKV\x01"
"""The first bytes of a page file (format version 1)."""
_LEN = struct.Struct("<I")
_DIGEST = 32
KV_FIELDS = ("k", "v", "k_scale", "v_scale")
"""A :class:`paged_jax.paging.kv_cache.KVPool`'s leaves, in the order a frame holds them (None ones absent)."""


def kv_fingerprint(params, kv: KVPool, *, extra: str = "") -> str:
    """What makes one engine's K/V another's: the SHA-256 (hex) of the
    model's weights (every leaf's path, dtype, shape and bytes), the pool's
    page size and its leaves' dtypes and shapes but for the page axis, and
    ``extra`` (e.g. a model identity that is not in the weights).

    Hashes every weight once: about a second per GiB on one core.
    """
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{x.dtype.name}:{x.shape};".encode())
        h.update(np.ascontiguousarray(x).view(np.uint8).reshape(-1).data)
    for x in jax.tree.leaves(kv):
        h.update(f"kv:{x.dtype.name}:{x.shape[:2] + x.shape[3:]};".encode())
    h.update(f"page_size:{kv.page_size};extra:{extra}".encode())
    return h.hexdigest()


FRAME_ERRORS = (ValueError, KeyError, TypeError, IndexError, struct.error, RecursionError)
"""What :func:`unpack_frame` raises on bytes that are not a frame."""


def pack_frame(header: dict, kv: KVPool | None = None) -> bytes:
    """``header`` and ``kv``'s leaves as bytes: a little-endian u32 length,
    ``header`` as JSON with ``"leaves"`` ``[[field, dtype, shape], ...]``
    added, then each leaf's bytes in that order (a page file's body after
    :data:`MAGIC`; a KV connector's message). No pickle: reading one runs no
    code.

    Raises:
      TypeError: ``header`` not JSON-serializable.
    """
    fields = [] if kv is None else [f for f in KV_FIELDS if getattr(kv, f) is not None]
    leaves = [np.ascontiguousarray(np.asarray(getattr(kv, f))) for f in fields]
    head = json.dumps({**header, "leaves": [[f, x.dtype.name, list(x.shape)] for f, x in zip(fields, leaves)]})
    return b"".join([_LEN.pack(len(head)), head.encode(), *(x.view(np.uint8).reshape(-1).data for x in leaves)])


def unpack_frame(data: bytes, start: int = 0) -> tuple[dict, KVPool | None]:
    """The header and K/V of a :func:`pack_frame` frame at ``data[start:]``,
    which must end where ``data`` does (the leaves copied out of ``data``).

    Raises:
      ValueError: not such a frame (short, long, an unknown or repeated
        field, a dtype that is not a plain one); so may KeyError,
        TypeError, IndexError and struct.error (all in
        :data:`FRAME_ERRORS`).
    """
    (n,) = _LEN.unpack_from(data, start)
    start += _LEN.size
    head = json.loads(data[start:start + n])
    if not isinstance(head, dict):
        raise ValueError("the header is not an object")
    leaves, offset = {}, start + n
    for field, dtype, shape in head.pop("leaves"):
        if field not in KV_FIELDS or field in leaves:
            raise ValueError(f"field {field!r}")
        dt, count = np.dtype(dtype), int(np.prod(shape))
        if dt.hasobject or dt != np.dtype(dt.name) or count < 0 or offset + count * dt.itemsize > len(data):
            raise ValueError("a leaf past the end")
        leaves[field] = np.frombuffer(data, dt, count, offset).reshape(shape).copy()
        offset += count * dt.itemsize
    if offset != len(data):
        raise ValueError("bytes past the last leaf")
    return head, (KVPool(**{f: leaves.get(f) for f in KV_FIELDS}) if leaves else None)


def _expected_len(data: bytes) -> int | None:
    """The length a page file's header says the file has, or None when
    the header cannot be read."""
    try:
        (n,) = _LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        head = json.loads(data[start:start + n])
        leaves = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _, dtype, shape in head["leaves"])
        return start + n + leaves + _DIGEST
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def page_layout(kv: KVPool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One page of ``kv``'s leaves: ``{field: (dtype name, shape)}``, the
    page axis 1 (what a page file must hold to be loaded into ``kv``)."""
    return {f: (dtype, shape[:2] + (1,) + shape[3:]) for f, (dtype, shape) in _leaves(kv).items()}


def _leaves(kv: KVPool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{field: (dtype name, shape)}`` of ``kv``'s leaves."""
    return {f: (getattr(kv, f).dtype.name, tuple(getattr(kv, f).shape))
            for f in KV_FIELDS if getattr(kv, f) is not None}


def encode_extra(extra: Hashable) -> list | None:
    """The extra key as JSON (a tuple of str / None / int); None when it
    cannot be written."""
    if not isinstance(extra, tuple) or not all(e is None or isinstance(e, (str, int)) for e in extra):
        return None
    return list(extra)


class DiskTier:
    """Cached pages in files under ``folder`` (module docstring).

    Args:
      folder: where the pages live (created if absent); several engines of
        other models may share it.
      capacity_bytes: bytes of files it keeps at most (>= 0).
      page_size: tokens per page.
      fingerprint: :func:`kv_fingerprint` of the engine that reads and
        writes it (hex, at least 32 characters).
      layout: what a page must hold (:func:`page_layout`); a file whose
        leaves differ is refused. None: not checked.

    Attributes:
      refused: files refused, by reason (``"truncated"``, ``"checksum"``,
        ``"header"`` (unreadable, or leaves not ``layout``'s), ``"foreign"``,
        ``"missing"``, ``"not a file"`` (a folder, a pipe, a device),
        ``"too large"``, ``"unreadable"`` (the OS refused the read)).
      foreign_fingerprints: other fingerprints' folders found at opening
        (pages another model or K/V dtype wrote: never served here).
      evicted_pages: files deleted to make room.

    Raises:
      ValueError: a bad ``capacity_bytes``, ``page_size`` or
        ``fingerprint``; ``folder`` that is a file.
    """

    def __init__(self, folder: str | os.PathLike, capacity_bytes: int, page_size: int, fingerprint: str, *,
                 layout: dict | None = None):
        self.capacity_bytes = check_int("capacity_bytes", capacity_bytes, 0)
        self.page_size = check_int("page_size", page_size)
        if not isinstance(fingerprint, str) or len(fingerprint) < 32 or any(
                c not in "0123456789abcdef" for c in fingerprint):
            raise ValueError(f"fingerprint must be a lowercase hex digest of at least 32 characters, got "
                             f"{fingerprint!r:.80}")
        root = pathlib.Path(folder)
        if root.exists() and not root.is_dir():
            raise ValueError(f"folder={str(folder)!r} is a file, expected a folder for the disk tier")
        self.fingerprint = fingerprint
        self.layout = None if layout is None else {f: (d, tuple(s)) for f, (d, s) in layout.items()}
        self.root = root / fingerprint[:32]
        self.root.mkdir(parents=True, exist_ok=True)
        self.foreign_fingerprints = sorted(p.name for p in root.iterdir() if p.is_dir() and p != self.root)
        self.refused: collections.Counter[str] = collections.Counter()
        self.evicted_pages = 0
        self.used_bytes = 0
        self._files: collections.OrderedDict[tuple[int, bytes], int] = collections.OrderedDict()  # LRU first -> size
        found = []
        for path in self.root.glob("g*/*.kv"):
            try:
                key = (int(path.parent.name[1:]), bytes.fromhex(path.stem))
                st = path.stat()
            except (ValueError, OSError):
                continue  # not a page file's name, or gone meanwhile
            if stat.S_ISREG(st.st_mode):  # a folder or a pipe under a page's name is never indexed
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.used_bytes += size
        self._shrink(0)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, group_key: tuple[int, bytes]) -> bool:
        return group_key in self._files

    def path(self, group: int, key: bytes) -> pathlib.Path:
        """The file of ``key`` in ``group``."""
        return self.root / f"g{group}" / f"{key.hex()}.kv"

    # ------------------------------------------------------------ writes

    def put(self, page: HostPage) -> bool:
        """Writes ``page`` as the most recently used file, deleting the
        least recently used ones until it fits. Returns False, writing
        nothing, when its key is held already, it is larger than the whole
        tier, or its extra key cannot be written (not a tuple of str, int
        or None).

        Raises:
          ValueError: ``page.tokens`` not ``page_size`` tokens.
          OSError: the write failed (the tier unchanged; a temporary file
            removed).
        """
        if len(page.tokens) != self.page_size:
            raise ValueError(f"page.tokens has {len(page.tokens)} tokens, expected page_size={self.page_size}")
        key = (check_int("page.group", page.group, 0), page.key)
        extra = encode_extra(page.extra)
        if key in self._files or extra is None:
            return False
        body = MAGIC + pack_frame({"fingerprint": self.fingerprint, "group": page.group, "key": page.key.hex(),
                                   "parent_key": page.parent_key.hex(), "tokens": [int(t) for t in page.tokens],
                                   "extra": extra}, page.kv)
        data = body + hashlib.sha256(body).digest()
        if len(data) > self.capacity_bytes:
            return False
        self._shrink(len(data))
        path = self.path(*key)
        path.parent.mkdir(parents=True, exist_ok=True)  # the folder may have been deleted meanwhile
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".kv")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
        self._files[key] = len(data)
        self.used_bytes += len(data)
        return True

    def _shrink(self, room: int) -> None:
        """Deletes least recently used files until ``room`` more bytes fit."""
        while self._files and self.used_bytes + room > self.capacity_bytes:
            key, size = self._files.popitem(last=False)
            self.used_bytes -= size
            self.evicted_pages += 1
            self.path(*key).unlink(missing_ok=True)

    # ------------------------------------------------------------- reads

    def _forget(self, key: tuple[int, bytes], reason: str, *, unlink: bool = True) -> None:
        """Refuses ``key``'s file: counted, out of the index, and deleted
        when ``unlink`` (not a folder or a pipe under its name)."""
        self.refused[reason] += 1
        self.used_bytes -= self._files.pop(key, 0)
        if unlink:
            try:
                self.path(*key).unlink(missing_ok=True)
            except OSError:
                pass

    def discard(self, group: int, key: bytes) -> bool:
        """Deletes ``(group, key)``'s file if this tier holds it (pages found
        bad after they were stored); returns whether it did."""
        if (group, key) not in self._files:
            return False
        self.used_bytes -= self._files.pop((group, key))
        try:
            self.path(group, key).unlink(missing_ok=True)
        except OSError:
            pass
        return True

    def read(self, group: int, key: bytes) -> HostPage | None:
        """The page of ``key`` in ``group``, its file verified (module
        docstring); None when not held, or refused (counted, deleted)."""
        k = (group, key)
        if k not in self._files:
            return None
        path = self.path(group, key)
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):  # a folder, a pipe, a device: reading it could hang or never end
                self._forget(k, "not a file", unlink=False)
                return None
            if st.st_size > self.capacity_bytes:
                self._forget(k, "too large")
                return None
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(k, "missing")
            return None
        except OSError:
            self._forget(k, "unreadable", unlink=False)
            return None
        if len(data) < len(MAGIC) + _LEN.size + _DIGEST:
            self._forget(k, "truncated")
            return None
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            expected = _expected_len(data)
            short = len(data) < self._files[k] or (expected is not None and len(data) < expected)
            self._forget(k, "truncated" if short else "checksum")
            return None
        try:
            if not body.startswith(MAGIC):
                raise ValueError("magic")
            head, kv = unpack_frame(body, len(MAGIC))
            if head["fingerprint"] != self.fingerprint or head["group"] != group or head["key"] != key.hex():
                self._forget(k, "foreign")
                return None
            if kv is None or kv.k is None or len(head["tokens"]) != self.page_size:
                raise ValueError("length")
            if self.layout is not None and _leaves(kv) != self.layout:
                raise ValueError("layout")
            page = HostPage(group=group, key=key, parent_key=bytes.fromhex(head["parent_key"]),
                            tokens=tuple(head["tokens"]), extra=tuple(head["extra"]), kv=kv)
        except FRAME_ERRORS:
            self._forget(k, "header")
            return None
        return page

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, start: int, max_pages: int, *,
               group: int = 0) -> list[HostPage]:
        """The longest run of pages ``start, start + 1, ...`` of ``tokens``
        whose files hold them, read and verified (as
        :meth:`paged_jax.tiers.host.HostTier.lookup`); a refused file ends
        the run. Hits are marked recently used."""
        group, start = check_int("group", group, 0), check_int("start", start, 0)
        max_pages = check_int("max_pages", max_pages, 0)
        run: list[HostPage] = []
        for j in range(start, min(max_pages, len(keys))):
            if (group, keys[j]) not in self._files and not self._adopt(group, keys[j]):
                break
            page = self.read(group, keys[j])
            if page is None or not holds_page(page, tokens, extra, j, self.page_size, keys=keys):
                break
            run.append(page)
        self.touch(group, [p.key for p in run])
        return run

    def _adopt(self, group: int, key: bytes) -> bool:
        """Takes into the index a file another engine or process wrote
        since this one opened the folder (it is read and verified like any
        other). Returns whether there was one."""
        try:
            st = self.path(group, key).stat()
        except (OSError, ValueError):
            return False
        size = st.st_size
        self._files[(group, key)] = size
        self.used_bytes += size
        return True

    def touch(self, group: int, keys: Sequence[bytes]) -> None:
        """Marks the files of ``keys`` most recently used (their
        modification time too, for the next process), the first the most:
        a chain's tail leaves before its head, without which it can never be
        hit."""
        for key in reversed(keys):
            if (group, key) in self._files:
                self._files.move_to_end((group, key))
                try:
                    os.utime(self.path(group, key))
                except FileNotFoundError:
                    pass

    def clear(self) -> int:
        """Deletes every page file of this fingerprint. Returns how many."""
        n = len(self._files)
        for key in list(self._files):
            self.path(*key).unlink(missing_ok=True)
        self._files.clear()
        self.used_bytes = 0
        return n
