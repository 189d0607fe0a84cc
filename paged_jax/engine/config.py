"""The engine's configuration: scheduler limits, the preemption mode, prefix
caching and the reservation policy (:class:`paged_jax.engine.core.Engine`).

Reservation policies. Besides paging on demand, the engine runs the
PagedAttention paper's baselines (Kwon et al., SOSP 2023, section 6.1):
pre-paging servers such as Orca reserve a sequence's slots when it is
admitted, for a length the server decides up front (:func:`reserved_tokens`):

- ``"paged"``: nothing reserved; pages are taken as the sequence grows (vLLM);
- ``"max"``: ``max_seq_len`` tokens (Orca (Max));
- ``"pow2"``: the prompt plus the next power of two of the true output
  length, at most ``max_seq_len`` ("if the true output length is 25, it
  reserves 32 positions for outputs"; Orca (Pow2));
- ``"oracle"``: the prompt plus exactly the true output length (Orca (Oracle)).

The true output length is the request's ``max_new_tokens``. Serving
benchmarks run with ``ignore_eos=True``, where that is exactly how long the
output is; with EOS allowed a sequence may stop sooner, and ``"oracle"``
then reserves the cap the request declared, not the length it turns out to
have. Attention work is the same under every policy: it is bounded by
each sequence's length, not by its reservation.

Allocators. Where a reservation is placed (``EngineConfig.allocator``,
:mod:`paged_jax.paging.contiguous`):

- ``"buddy"`` (the default under a reservation policy): one contiguous run
  per sequence, rounded up to a power of two of pages and placed by the
  buddy allocator, as the paper's Orca (section 6.1). An admission waits
  when no run fits though enough pages are free (external fragmentation,
  counted in :class:`paged_jax.engine.stats.EngineStats`);
- ``"first_fit"``: one contiguous run of exactly the reservation, first fit;
- ``"pages"``: a reservation is only a count of pages, which removes
  external fragmentation and the buddy's rounding: a kinder Orca than the
  paper's, which *understates* what paging gains.

The device pages underneath under every allocator, so every policy runs the
same programs; the runs decide only what is admitted when.
"""

from __future__ import annotations

import dataclasses
import os

from paged_jax.attention.batch import Tiling
from paged_jax.checks import check_bool, check_choice, check_instance, check_int
from paged_jax.engine.stats import DEFAULT_CALL_RECORDS
from paged_jax.paging.contiguous import ALLOCATORS
from paged_jax.speculative.config import SpeculativeConfig
from paged_jax.tiers.connector import KVTransferConfig

RESERVATIONS = ("paged", "max", "pow2", "oracle")
"""The values of ``EngineConfig.reservation``."""

RESERVATION_ALLOCATORS = (*ALLOCATORS, "pages")
"""The values of ``EngineConfig.allocator`` (under a reservation policy)."""


def reserved_tokens(policy: str, prompt_len: int, max_new_tokens: int, max_seq_len: int) -> int:
    """Tokens one sequence holds pages for from its admission on, however
    short it still is, under reservation ``policy`` (one of
    :data:`RESERVATIONS`; see the module docstring). The one place the rule
    lives: the KV manager's costs and growth and a request's check against
    the pool all ask here. Every sequence of a group (parallel samples,
    beams) reserves the same.

    Args:
      policy: "paged" (0: nothing reserved), "max", "pow2" or "oracle".
      prompt_len: the request's prompt tokens.
      max_new_tokens: its output cap, taken as the true output length
        (exact with ``ignore_eos``).
      max_seq_len: the engine's most tokens per sequence; no policy
        reserves more.

    Returns:
      e.g. with ``prompt_len=5, max_new_tokens=25, max_seq_len=80``: paged
      0, max 80, pow2 5 + 32 = 37, oracle 5 + 25 = 30.

    Raises:
      ValueError: an unknown ``policy``.
    """
    check_choice("policy", policy, RESERVATIONS)
    if policy == "paged":
        return 0
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(prompt_len + (1 << (max_new_tokens - 1).bit_length()), max_seq_len)
    return min(prompt_len + max_new_tokens, max_seq_len)  # oracle


def _check_folder(name: str, path: str) -> None:
    """A folder that exists, or that can be made where its nearest existing
    ancestor is a writable folder; checked without making it.

    Raises:
      ValueError: naming ``name`` and ``path``.
    """
    if not path.strip() or "\0" in path:
        raise ValueError(f"{name}={path!r} is not a folder path (empty, blank or holding a NUL byte)")
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{name}={path!r} is a file, expected a folder")
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p) or not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={path!r} cannot be written: {p!r} is not a writable folder")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Scheduler limits.

    Attributes:
      max_seqs: most sequences running at once, >= 1.
      max_seq_len: most tokens per sequence, prompt plus output, >= 1.
      max_num_batched_tokens: tokens per model call, decode tokens and
        prefill chunks together (the token budget of chunked prefill);
        >= ``max_seqs`` so every running sequence can decode in one call.
      reservation: the tokens each sequence holds pages for from its
        admission on: "paged" (none: pages on demand), "max", "pow2" or
        "oracle" (the paper's Orca baselines; see the module docstring and
        :func:`reserved_tokens`).
      allocator: where a reservation is placed, under a reservation policy:
        "buddy" (one power-of-two run per sequence, the paper's Orca),
        "first_fit" (one exact run) or "pages" (a count of pages, no
        external fragmentation); see the module docstring. None (the
        default): "buddy" under a reservation policy; paging on demand
        takes None only.
      tiling: how attention cuts a call into work, and how many prefill
        chunks one call carries (:class:`paged_jax.attention.batch.Tiling`).
      async_scheduling: schedule and dispatch iteration ``i + 1`` before
        reading iteration ``i``'s sampled tokens (they reach ``i + 1``'s
        input on device), so the host's work overlaps the device's, as in
        vLLM's async scheduling. A sequence that stops on a stop token then
        computes one token more, which is discarded. Outputs are the same
        either way.
      enable_prefix_caching: keep full pages keyed by their tokens after
        their sequence ends, and let a new (or recomputed) sequence whose
        first pages equal them take them instead of prefilling
        (:mod:`paged_jax.paging.prefix_cache`).
      preemption_mode: "recompute" (free a preempted group's pages and
        prefill its tokens again when resumed) or "swap" (copy its pages to
        host memory and back, :mod:`paged_jax.paging.swap`; paper section 4.5). A
        group that does not fit in the swap space is recomputed.
      swap_space_pages: pages the swap space holds; default as many as the
        KV pool's usable pages.
      host_cache_bytes: bytes of K/V the prefix cache's host tier holds
        (:mod:`paged_jax.tiers`): a cached page the pool evicts is copied
        there, and a prefix hit that runs on into it loads it back before
        the request's first call; 0 (the default): no host tier. Needs
        prefix caching and a model whose layers all attend every token.
      disk_cache_dir: a folder (``~`` expanded) for the prefix cache's disk tier
        (:mod:`paged_jax.tiers.disk`): every cached page is stored there
        once computed, under the model's fingerprint, and a hit that runs
        on past the device and host tiers loads it back, in this process
        or a later one; None (the default): no disk tier. Needs prefix
        caching, a model whose layers all attend every token, and
        ``disk_cache_bytes``.
      disk_cache_bytes: bytes of page files the disk tier keeps (least
        recently used deleted first).
      kv_transfer: a KV connector to another engine process
        (:class:`paged_jax.tiers.connector.KVTransferConfig`): a producer
        keeps every cached page for consumers and serves them, a consumer
        loads the pages a producer holds after its own tiers'
        (prefill/decode disaggregation); None (the default): none. Needs
        prefix caching and a model whose layers all attend every token.
      drop_out_of_window_pages: when every layer of the model attends a
        sliding window (``PagedModel.kv_window``), or a hybrid model's
        pool is laid out by layer group (``PagedModel.kv_groups``,
        :mod:`paged_jax.paging.kv_groups`), return the pages that left a window to
        the pool while the sequence runs (:mod:`paged_jax.paging.sliding_window`);
        False keeps every page until the sequence ends (the same outputs,
        more memory; a hybrid model then needs a pool of every layer).
      call_records: how many of the latest model calls keep a
        :class:`paged_jax.engine.stats.CallRecord` in ``engine.stats.calls``
        (default 1,024, a window, so a long-lived engine's statistics stay
        bounded); None keeps every call's, for a benchmark that needs each.
        The counters and per-shape call counts cover every call either way.
      speculative: speculative decoding: the proposer and the tokens each
        decoding sequence proposes per call
        (:class:`paged_jax.speculative.config.SpeculativeConfig`); None
        (the default): none.
    """

    max_seqs: int = 64
    max_seq_len: int = 2048
    max_num_batched_tokens: int = 256
    reservation: str = "paged"
    allocator: str | None = None
    tiling: Tiling = Tiling()
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_pages: int | None = None
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    kv_transfer: KVTransferConfig | None = None
    drop_out_of_window_pages: bool = True
    call_records: int | None = DEFAULT_CALL_RECORDS
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        for name in ("max_seqs", "max_seq_len", "max_num_batched_tokens"):
            check_int(name, getattr(self, name))
        check_instance("tiling", self.tiling, Tiling, what="paged_jax.attention.batch.Tiling")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_seqs (every running sequence decodes in each call), "
                f"got max_num_batched_tokens={self.max_num_batched_tokens} max_seqs={self.max_seqs}"
            )
        check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        check_choice("reservation", self.reservation, RESERVATIONS)
        if self.reservation == "paged":
            if self.allocator is not None:
                raise ValueError(f"allocator={self.allocator!r} with reservation='paged': paging on demand places "
                                 "no reservation; pass allocator=None, or a reservation policy")
        else:
            if self.allocator is None:
                object.__setattr__(self, "allocator", "buddy")
            check_choice("allocator", self.allocator, RESERVATION_ALLOCATORS)
        if self.swap_space_pages is not None:
            check_int("swap_space_pages", self.swap_space_pages, 0)
        object.__setattr__(self, "host_cache_bytes", check_int("host_cache_bytes", self.host_cache_bytes, 0))
        if self.host_cache_bytes and not self.enable_prefix_caching:
            raise ValueError(f"host_cache_bytes={self.host_cache_bytes} needs enable_prefix_caching=True (the host "
                             "tier keeps the prefix cache's evicted pages); pass 0 or turn prefix caching on")
        object.__setattr__(self, "disk_cache_bytes", check_int("disk_cache_bytes", self.disk_cache_bytes, 0))
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, (str, os.PathLike)) or not str(self.disk_cache_dir):
                raise ValueError(f"disk_cache_dir must be a folder path (str), got {self.disk_cache_dir!r}")
            # "~/kv" names the home folder's kv, as on a command line, not a folder called "~" here.
            object.__setattr__(self, "disk_cache_dir", os.path.expanduser(os.fspath(self.disk_cache_dir)))
            _check_folder("disk_cache_dir", self.disk_cache_dir)
            if not self.disk_cache_bytes:
                raise ValueError(f"disk_cache_dir={self.disk_cache_dir!r} needs disk_cache_bytes > 0 (the files it "
                                 "may keep), got disk_cache_bytes=0")
            if not self.enable_prefix_caching:
                raise ValueError(f"disk_cache_dir={self.disk_cache_dir!r} needs enable_prefix_caching=True (the disk "
                                 "tier keeps the prefix cache's pages)")
        elif self.disk_cache_bytes:
            raise ValueError(f"disk_cache_bytes={self.disk_cache_bytes} without disk_cache_dir: name the folder")
        if self.kv_transfer is not None:
            check_instance("kv_transfer", self.kv_transfer, KVTransferConfig,
                           what="paged_jax.tiers.connector.KVTransferConfig")
            if not self.enable_prefix_caching:
                raise ValueError(f"kv_transfer (a KV {self.kv_transfer.role}) needs enable_prefix_caching=True (the "
                                 "connector hands the prefix cache's pages between engines)")
        for name in ("async_scheduling", "enable_prefix_caching", "drop_out_of_window_pages"):
            check_bool(name, getattr(self, name))
        if self.call_records is not None:  # a plain int, as deque(maxlen=...) needs
            object.__setattr__(self, "call_records", check_int("call_records", self.call_records, 0, 1 << 30))
        if self.speculative is not None:
            check_instance("speculative", self.speculative, SpeculativeConfig,
                           what="paged_jax.speculative.config.SpeculativeConfig")

    @property
    def pages_by_layer_group(self) -> bool:
        """Whether a hybrid model's pool should be laid out by layer group
        (a block table per group, :mod:`paged_jax.paging.kv_groups`): when pages
        leave a window at all and the policy pages on demand. A reservation
        policy (the paper's Orca, a contiguous cache) keeps every layer's
        pages in one table, as such a system does."""
        return self.drop_out_of_window_pages and self.reservation == "paged"
