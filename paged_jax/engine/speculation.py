"""The engine's side of speculative decoding (Leviathan et al., 2023; Chen
et al., 2023): who proposes before a call is planned, and what a call that
verified proposals emits.

:class:`Speculator` is what an engine with ``EngineConfig.speculative``
holds: before the scheduler plans a call it gives each running sequence
that may speculate its proposals (``Sequence.draft``: the scheduler counts
them among the sequence's tokens, so they take lookahead slots of its
pages and may be cut by the token budget), and after the call it turns the
verification rows' verdicts into tokens and rewinds ``num_computed`` past
the rejected ones (the pages follow in
:meth:`paged_jax.engine.kv_manager.KVCacheManager.rollback`).

:class:`DraftModelProposer` proposes with a draft model
(:class:`paged_jax.speculative.config.DraftModel`) run by an engine of its
own: each round adds one greedy request per proposing sequence, whose
prompt is the sequence's tokens, and runs it for ``k`` tokens; the draft
engine's prefix cache keeps every full page of draft K/V between rounds, so
a round computes only the tokens past the sequence's last full page, then
``k - 1`` one-token decodes, batched across sequences. A rejected proposal
is never a false hit there either: the cache keys pages by their token ids.
"""

from __future__ import annotations

import time
from typing import Callable
from typing import Sequence as Seq

import numpy as np

from paged_jax.engine.config import EngineConfig
from paged_jax.engine.requests import Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.sequence import Sequence
from paged_jax.engine.stats import EngineStats
from paged_jax.paging.kv_cache import KVPool
from paged_jax.speculative.config import DraftModel, SpeculativeConfig


class DraftModelProposer:
    """Greedy proposals from a draft model, batched across sequences.

    Args:
      engine: the draft's engine (an ``Engine`` over the draft model and
        its own pool, built with prefix caching on and no stop tokens):
        :meth:`Speculator.build` makes it.

    Attributes:
      engine: that engine; its ``stats`` count the draft's calls and its
        prefix-cache hits.
      seconds: wall time spent proposing, seconds (the draft's compilations
        included: its engine's ``stats.compile_s`` says how much).
      rounds: calls of :meth:`propose_batch`.
    """

    def __init__(self, engine):
        self.engine = engine
        self.seconds = 0.0
        self.rounds = 0

    def __repr__(self) -> str:
        return f"DraftModelProposer({type(self.engine.model).__name__})"

    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
        """Up to ``k`` proposals after ``token_ids`` (:meth:`propose_batch` of one)."""
        return self.propose_batch([token_ids], [k])[0]

    def propose_batch(self, token_ids: list[Seq[int]], ks: list[int]) -> list[list[int]]:
        """The draft's ``ks[i]`` greedy tokens after each ``token_ids[i]``,
        computed together (one draft request per sequence; the draft engine
        batches, preempts and caches them like any requests).

        Raises:
          ValueError: a sequence the draft engine refuses (longer than its
            ``max_seq_len``, an id outside its vocabulary), named by it.
        """
        t0 = time.perf_counter()
        requests = [Request(request_id=i, prompt_ids=list(ids), max_new_tokens=k, ignore_eos=True,
                            sampling=SamplingParams())
                    for i, (ids, k) in enumerate(zip(token_ids, ks)) if k > 0]
        out = {o.request_id: o.outputs[0].output_ids for o in self.engine.run(requests)}
        self.rounds += 1
        self.seconds += time.perf_counter() - t0
        return [out.get(i, []) for i in range(len(token_ids))]

    def update_weights(self, params) -> None:
        """The draft serves ``params`` from now on (its prefix cache reset)."""
        self.engine.update_weights(params)


class Speculator:
    """Proposals before a call, verdicts after it.

    Args:
      config: the engine's :class:`paged_jax.speculative.config.SpeculativeConfig`.
      proposer: what proposes: ``config.proposer``, or the
        :class:`DraftModelProposer` built for its :class:`DraftModel`.
      vocab_size: proposals must be ids below it (the model's vocabulary:
        the target samples from all of it, whatever ids prompts may use).
      draft_layers: the early-exit draft's ``num_layers`` (its weights
        follow :meth:`update_weights`), else None.
    """

    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int | None, draft_layers: int | None = None):
        self.config = config
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.draft_layers = draft_layers

    @classmethod
    def build(cls, config: SpeculativeConfig, *, model, kv_pool: KVPool, engine_config: EngineConfig,
              vocab_size: int | None, num_groups: int, make_engine: Callable) -> Speculator:
        """The speculator of an engine over ``model`` and ``kv_pool`` (whose
        pages serve ``num_groups`` layer groups); a :class:`DraftModel`
        proposer gets a draft engine (``make_engine(draft_model, draft_pool,
        draft_config)``) whose pool has the target's K/V dtype,
        ``page_size`` (default the target's) and ``kv_tokens`` tokens in
        each of the draft's layer groups (default: as many as the target's
        pool holds in each of its groups, so the draft's bytes are the
        target's times draft layers / target layers), and whose limits are
        the target's ``max_seqs``, ``max_seq_len`` and
        ``max_num_batched_tokens``.

        Raises:
          ValueError: an early-exit draft of a model without
            ``early_exit`` or with ``num_layers`` not below its layers, a
            draft whose vocabulary differs from the target's, or a draft
            pool smaller than one sequence of ``max_seq_len``.
        """
        spec = config.proposer
        if not isinstance(spec, DraftModel):
            return cls(config, spec, vocab_size)
        if spec.model is None:
            if not callable(getattr(model, "early_exit", None)):
                raise ValueError(f"DraftModel(num_layers={spec.num_layers}) drafts with the model's first layers: "
                                 f"the model must have early_exit(num_layers) (models.ragged.RaggedModel), got a "
                                 f"{type(model).__name__}")
            try:
                draft = model.early_exit(spec.num_layers)
            except ValueError as e:  # named as the config says it (the flag is --draft-layers)
                raise ValueError(f"DraftModel(num_layers={spec.num_layers!r}) (--draft-layers): {e}") from None
        else:
            draft = spec.model
        draft_vocab, target_vocab = getattr(draft, "vocab_size", None), getattr(model, "vocab_size", None)
        if draft_vocab != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab} tokens) is not the target's "
                             f"({target_vocab}): a draft must share the target's tokenizer")
        page = kv_pool.page_size if spec.page_size is None else spec.page_size
        tokens = ((kv_pool.num_pages - 1) * kv_pool.page_size // num_groups if spec.kv_tokens is None
                  else spec.kv_tokens)  # per layer group
        if tokens // page * page < engine_config.max_seq_len:
            raise ValueError(f"the draft's pool (DraftModel kv_tokens={tokens} per layer group, page_size={page}) "
                             f"holds {tokens // page * page} tokens in whole pages, fewer than one sequence of "
                             f"max_seq_len={engine_config.max_seq_len}")
        groups = getattr(draft, "kv_groups", None)
        draft_groups = 1 if groups is None else groups.num_groups  # the draft engine keeps a table per group
        num_pages = tokens // page * draft_groups + 1
        draft_config = EngineConfig(max_seqs=engine_config.max_seqs, max_seq_len=engine_config.max_seq_len,
                                    max_num_batched_tokens=engine_config.max_num_batched_tokens,
                                    enable_prefix_caching=True, async_scheduling=False)
        pool = draft.make_kv_pool(num_pages, page, kv_pool.k.dtype)
        proposer = DraftModelProposer(make_engine(draft, pool, draft_config))
        return cls(config, proposer, vocab_size, spec.num_layers if spec.model is None else None)

    def active(self, num_running: int) -> bool:
        """Whether sequences may propose in the next call: then the call
        before it is read first (its proposals follow from what that one
        kept), else it may stay in flight (``async_scheduling``)."""
        cap = self.config.disable_by_batch_size
        return cap is None or num_running < cap

    def propose(self, running: list[Sequence]) -> None:
        """Gives each running sequence that decodes and may speculate its
        proposals (``Sequence.draft``); a proposer with
        ``propose_batch(token_ids, ks)`` is asked once for all of them.

        Who never proposes: a sequence with a token in flight, beam search,
        a request asking for ``logprobs``, a sequence before its first
        token (its parallel samples fork from the call that samples it),
        one mid-prefill, and one with fewer than two tokens left.

        Raises:
          ValueError: the proposer returned something other than at most
            ``k`` token ids of the vocabulary (named, with the request), or
            ``propose_batch`` returned other than one list per sequence.
          RuntimeError: the proposer raised (named, with the request, or
            with every request of a batch).
        """
        if not self.active(len(running)):
            return
        asks = []
        for seq in running:
            if (seq.pending or seq.done or seq.group.beam or seq.logprobs is not None or not seq.num_generated
                    or seq.num_computed != len(seq.tokens) - 1):
                continue
            k = min(self.config.num_speculative_tokens, seq.request.max_new_tokens - seq.num_generated - 1)
            if k >= 1:
                asks.append((seq, k))
        if not asks:
            return
        proposer = self.proposer
        batch = getattr(proposer, "propose_batch", None)
        try:  # copies: a proposer never changes the sequence it reads
            if callable(batch):
                drafts = batch([tuple(seq.tokens) for seq, _ in asks], [k for _, k in asks])
            else:
                drafts = []
                for seq, k in asks:
                    who = seq
                    drafts.append(proposer.propose(tuple(seq.tokens), k))
        except Exception as e:
            names = [seq.request.request_id for seq, _ in asks] if callable(batch) else [who.request.request_id]
            which = f"request {names[0]!r}" if len(names) == 1 else f"requests {names!r:.200}"
            raise RuntimeError(f"proposer {proposer!r:.80} raised {type(e).__name__}: {e} for {which}") from e
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(asks):
            raise ValueError(f"proposer {proposer!r:.80} returned {drafts!r:.120} from propose_batch: expected a "
                             f"list of {len(asks)} proposal lists, one per sequence asked")
        for (seq, k), draft in zip(asks, drafts):
            if (not isinstance(draft, (list, tuple)) or len(draft) > k
                    or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                               and 0 <= t < self.vocab_size for t in draft)):
                raise ValueError(f"proposer {proposer!r:.80} returned {draft!r:.120} for request "
                                 f"{seq.request.request_id!r}: expected a list of at most k={k} token ids in "
                                 f"[0, {self.vocab_size})")
            seq.draft = [int(t) for t in draft]

    def verify(self, verifiers: list[tuple[Sequence, list[int], int]], verify, sampled: np.ndarray,
               stats: EngineStats) -> dict[Sequence, list[int]]:
        """The tokens each sequence that verified proposals in a call emits:
        its accepted proposals, then the target's own token (the correction
        at the first rejection, read from ``verify``, or the bonus from
        ``sampled`` when all are accepted). Their K/V past the accepted ones
        are forgotten (``num_computed`` rewound), and the counts go to
        ``stats`` and the sequence.

        Args:
          verifiers: (sequence, its proposals, its first verification row)
            of the call.
          verify: the call's ``(bool[V] accepted, i32[V] each row's token)``.
          sampled: i32[S] the call's sampled token per page-state row.
        """
        out = {}
        if not verifiers:
            return out
        accept, tokens = verify
        for seq, proposals, first in verifiers:
            seq.draft = []
            if seq.done:
                continue
            d = len(proposals)
            rows = accept[first:first + d]
            a = d if rows.all() else int(np.argmin(rows))  # leading accepted proposals
            out[seq] = proposals[:a] + [int(sampled[seq.slot]) if a == d else int(tokens[first + a])]
            seq.num_computed -= d - a
            seq.num_proposed += d
            seq.num_accepted += a
            stats.record_verification(d, a)
        return out

    def reset_prefix_cache(self) -> None:
        """A draft model's engine forgets its cached pages."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.engine.reset_prefix_cache()

    def update_weights(self, model, params) -> None:
        """After the target's weights change: the early-exit draft takes the
        new weights' first layers (a separate draft checkpoint keeps its
        own)."""
        if self.draft_layers is not None:
            self.proposer.update_weights(model.early_exit(self.draft_layers, params).params)
