"""The disk tier's store (paged_jax.tiers.disk): pages written as files under the
model's fingerprint come back bit for bit (float, bf16, int8, fp8, latent),
least recently used files go first by exact bytes and keep their order for
the next process, a chain is found only where tokens, salt and parent agree,
and a file that is short, corrupted, foreign or gone is refused by reason,
deleted and never served.

The engine's use of it (a second engine on the same folder, faults mid-run,
a hit across all three tiers): tests/test_kv_tiers.py.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.paging.kv_cache import KVPool, init_kv_pool, init_latent_pool
from paged_jax.paging.prefix_cache import ROOT_KEY, chain_keys
from paged_jax.paging.swap import gather_pages
from paged_jax.tiers.disk import MAGIC, DiskTier, kv_fingerprint
from paged_jax.tiers.host import HostPage, page_copies
from pallas_kernels.common import QUANTIZED_KV_DTYPES, is_quantized

L = 4
FP = "0123456789abcdef" * 4


def _pool(dtype, num_pages=8, seed=0) -> KVPool:
    if dtype == "latent":
        pool = init_latent_pool(num_layers=2, num_pages=num_pages, page_size=L, latent_dim=8)
        return pool.replace(k=jnp.asarray(np.random.default_rng(seed).normal(size=pool.k.shape), pool.k.dtype))
    k = np.random.default_rng(seed).normal(size=(2, 3, num_pages, L, 8)).astype(np.float32)
    if is_quantized(dtype):
        return KVPool(k=jnp.asarray(k * 10, dtype), v=jnp.asarray(-k * 10, dtype),
                      k_scale=jnp.asarray(k[..., 0]), v_scale=jnp.asarray(-k[..., 1]))
    return KVPool(k=jnp.asarray(k, dtype), v=jnp.asarray(-k, dtype))


def _pages(pool, n, extra=(None,), start_token=0):
    tokens = list(range(start_token, start_token + (n + 1) * L))
    keys = chain_keys(tokens, L, extra, [])
    kvs = page_copies(gather_pages(pool, list(range(1, n + 1))), n)
    return tokens, keys, [HostPage(group=0, key=keys[j], parent_key=keys[j - 1] if j else ROOT_KEY,
                                   tokens=tuple(tokens[j * L:(j + 1) * L]), extra=extra, kv=kvs[j]) for j in range(n)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, *QUANTIZED_KV_DTYPES, "latent"],
                         ids=lambda d: d if isinstance(d, str) else jnp.dtype(d).name)
def test_pages_leave_and_return_bit_for_bit(tmp_path, dtype):
    tokens, keys, pages = _pages(_pool(dtype), 3)
    tier = DiskTier(tmp_path, 1 << 20, L, FP)
    assert all(tier.put(p) for p in pages) and len(tier) == 3
    assert not tier.put(pages[0])  # held already
    again = DiskTier(tmp_path, 1 << 20, L, FP)  # another process opening the folder
    found = again.lookup(tokens, keys, (None,), 0, 3)
    assert [p.key for p in found] == keys[:3]
    for old, new in zip(pages, found):
        assert (new.tokens, new.extra, new.parent_key) == (old.tokens, old.extra, old.parent_key)
        for a, b in zip(jax.tree.leaves(old.kv), jax.tree.leaves(new.kv)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert again.used_bytes == tier.used_bytes == sum(f.stat().st_size for f in tmp_path.rglob("*.kv"))


def test_lookup_checks_tokens_salt_and_parent(tmp_path):
    tokens, keys, pages = _pages(_pool(jnp.float32), 4, extra=("alice",))
    tier = DiskTier(tmp_path, 1 << 20, L, FP)
    for p in pages[1:]:
        tier.put(p)
    assert tier.lookup(tokens, keys, ("alice",), 0, 4) == []  # page 0 missing: a run starts where asked
    assert len(tier.lookup(tokens, keys, ("alice",), 1, 4)) == 3
    assert len(tier.lookup(tokens, keys, ("alice",), 1, 3)) == 2  # bounded
    assert tier.lookup(tokens, keys, ("bob",), 1, 4) == []  # another salt
    forged = tokens[:L + 1] + [999] + tokens[L + 2:]  # page 1's tokens differ under the same keys
    assert tier.lookup(forged, keys, ("alice",), 1, 4) == []


def test_least_recently_used_files_go_first_and_keep_their_order_for_the_next_process(tmp_path):
    tokens, keys, pages = _pages(_pool(jnp.float32), 4, start_token=1000)  # 4-digit tokens: files of one size
    probe = DiskTier(tmp_path / "probe", 1 << 20, L, FP)
    probe.put(pages[1])  # page 0 names the root as its parent: its header is a little shorter
    size = probe.used_bytes
    tier = DiskTier(tmp_path / "t", 3 * size, L, FP)
    for p in pages[:3]:
        assert tier.put(p)
        time.sleep(0.01)  # distinct modification times
    tier.touch(0, [keys[0]])  # 1 is now the least recently used
    assert tier.put(pages[3]) and tier.evicted_pages == 1
    assert (0, keys[1]) not in tier and not tier.path(0, keys[1]).exists()
    again = DiskTier(tmp_path / "t", 2 * size, L, FP)  # a smaller bound at opening: the oldest goes
    assert len(again) == 2 and (0, keys[2]) not in again and (0, keys[0]) in again and (0, keys[3]) in again
    assert not DiskTier(tmp_path / "tiny", size - 1, L, FP).put(pages[1])  # larger than the whole tier


@pytest.mark.parametrize("fault", ["truncated", "checksum", "header", "foreign", "missing"])
def test_a_bad_file_is_refused_by_reason_deleted_and_never_served(tmp_path, fault):
    tokens, keys, pages = _pages(_pool(jnp.float32), 3)
    tier = DiskTier(tmp_path, 1 << 20, L, FP)
    for p in pages:
        tier.put(p)
    path = tier.path(0, keys[1])
    data = path.read_bytes()
    if fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "checksum":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif fault == "header":  # a well-formed file whose header is not JSON
        import hashlib
        body = MAGIC + (5).to_bytes(4, "little") + b"{nope" + data[len(MAGIC) + 4:-32]
        path.write_bytes(body + hashlib.sha256(body).digest())
    elif fault == "foreign":  # another model's page file under this key
        other = DiskTier(tmp_path / "other", 1 << 20, L, "f" * 64)
        other.put(pages[1])
        path.write_bytes(other.path(0, keys[1]).read_bytes())
    else:
        path.unlink()
    found = tier.lookup(tokens, keys, (None,), 0, 3)
    assert [p.key for p in found] == keys[:1]  # the run ends before the bad file
    assert tier.refused == {fault: 1} and not path.exists() and (0, keys[1]) not in tier
    assert tier.lookup(tokens, keys, (None,), 0, 3)[0].key == keys[0] and tier.refused == {fault: 1}


def test_fingerprints_separate_models_page_sizes_and_dtypes(tmp_path):
    params = {"w": jnp.arange(6.0)}
    pool = init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=4, page_size=L, head_dim=8, dtype=jnp.float32)
    fp = kv_fingerprint(params, pool)
    assert fp == kv_fingerprint({"w": jnp.arange(6.0)}, init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=9,
                                                                      page_size=L, head_dim=8))  # pages: no matter
    others = [kv_fingerprint({"w": jnp.arange(6.0) + 1}, pool),
              kv_fingerprint(params, init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=4, page_size=8, head_dim=8)),
              kv_fingerprint(params, init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=4, page_size=L, head_dim=8,
                                                  dtype=jnp.bfloat16)),
              kv_fingerprint(params, init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=4, page_size=L, head_dim=8,
                                                  dtype=jnp.int8)),
              kv_fingerprint(params, pool, extra="another checkpoint")]
    assert len({fp, *others}) == 6
    tokens, keys, pages = _pages(_pool(jnp.float32), 2)
    DiskTier(tmp_path, 1 << 20, L, fp).put(pages[0])
    mine = DiskTier(tmp_path, 1 << 20, L, others[0])
    assert mine.lookup(tokens, keys, (None,), 0, 2) == [] and mine.foreign_fingerprints == [fp[:32]]


def test_bad_arguments_are_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("x")
    for kwargs, words in [(dict(capacity_bytes=-1), "capacity_bytes must be an int >= 0"),
                          (dict(page_size=0), "page_size must be an int >= 1"),
                          (dict(fingerprint="xyz"), "fingerprint must be a lowercase hex digest"),
                          (dict(folder=tmp_path / "file"), "is a file, expected a folder")]:
        args = dict(folder=tmp_path / "ok", capacity_bytes=10, page_size=L, fingerprint=FP) | kwargs
        with pytest.raises(ValueError, match=words):
            DiskTier(**args)
    tier = DiskTier(tmp_path / "ok", 1 << 20, L, FP)
    _, _, pages = _pages(_pool(jnp.float32), 1)
    with pytest.raises(ValueError, match="page.tokens has 3 tokens, expected page_size=4"):
        tier.put(HostPage(group=0, key=b"k", parent_key=ROOT_KEY, tokens=(1, 2, 3), extra=(None,), kv=pages[0].kv))
    assert not tier.put(HostPage(group=0, key=b"k", parent_key=ROOT_KEY, tokens=(1, 2, 3, 4), extra=(object(),),
                                 kv=pages[0].kv))  # an extra key that cannot be written: not stored
    assert not list((tmp_path / "ok").rglob(".tmp-*")) and os.listdir(tmp_path / "ok")


def test_a_file_another_process_wrote_after_opening_is_found_and_verified(tmp_path):
    tokens, keys, pages = _pages(_pool(jnp.float32), 2)
    reader = DiskTier(tmp_path, 1 << 20, L, FP)  # opened on an empty folder
    writer = DiskTier(tmp_path, 1 << 20, L, FP)
    for p in pages:
        writer.put(p)
    found = reader.lookup(tokens, keys, (None,), 0, 2)
    assert [p.key for p in found] == keys[:2] and len(reader) == 2 and reader.used_bytes == writer.used_bytes
    path = writer.path(0, keys[0])
    path.write_bytes(path.read_bytes()[:-3])  # another process tears a file: refused, not served
    fresh = DiskTier(tmp_path, 1 << 20, L, FP)
    assert fresh.lookup(tokens, keys, (None,), 0, 2) == [] and fresh.refused == {"truncated": 1}
