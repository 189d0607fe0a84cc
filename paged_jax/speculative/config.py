"""How an engine speculates: its proposer and how many tokens a sequence
proposes per call (``EngineConfig.speculative``).

vLLM's ``speculative_config`` (``method="ngram"``,
``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max``)
is :meth:`SpeculativeConfig.ngram`; its ``method="draft_model"`` is
:meth:`SpeculativeConfig.draft` (a :class:`DraftModel`: a separate
checkpoint, or the model's own first layers); a researcher's own proposer
is any :class:`paged_jax.speculative.proposers.Proposer` passed as
``proposer``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_jax.checks import check_int
from paged_jax.speculative.proposers import NgramProposer, Proposer

MAX_SPECULATIVE_TOKENS = 64
"""Most tokens a sequence may propose per call: each is a query token of
the call and a slot of its pages reserved ahead."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModel:
    """A draft model as the proposer: its greedy continuation is proposed
    (vLLM's ``method="draft_model"``; a draft's argmax is a deterministic
    proposal, which :func:`paged_jax.engine.sampling.verify_proposals`
    verifies exactly for sampled requests too).

    Each engine runs the draft in an engine of its own
    (:class:`paged_jax.engine.speculation.DraftModelProposer`): its own
    pool and block tables, its own prefix cache. Own pages, not a layer
    group of the target's pool: a draft checkpoint's layers rarely have
    the target's KV heads and head size, and even the early-exit draft,
    whose K/V equal the target's first layers', writes them for proposals
    the target later rejects. The cost: at the default size the early
    exit's pool is ``num_layers / target layers`` of the target's bytes,
    and each round recomputes the draft K/V of the tokens past the last
    full cached page, then makes ``k - 1`` one-token calls (SmolLM2's first
    8 layers: ``results/speculative_early_exit.md``).

    Give one of:
      model: a ``PagedModel`` (:class:`paged_jax.engine.step.PagedModel`)
        with the target's vocabulary and ``make_kv_pool(num_pages,
        page_size, dtype)`` (``models.ragged.RaggedModel``): a separate
        checkpoint.
      num_layers: the target's own first ``num_layers`` blocks, then its
        final norm and head (early exit, LayerSkip;
        ``models.ragged.RaggedModel.early_exit``): the target must have
        ``early_exit(num_layers, params)``.

    Attributes:
      kv_tokens: tokens the draft's pool holds in each of its layer groups
        (whole pages; one group unless the draft mixes sliding-window and
        full layers); default: as many as the target's pool holds in each
        of its groups, which makes the early exit's pool ``num_layers /
        target layers`` of the target's bytes.
      page_size: tokens per page of the draft's pool; default the
        target's. A round recomputes the draft K/V past the sequence's last
        full page, about ``page_size / 2`` tokens a sequence (SmolLM2's
        early exit with pages of 4 and of 16 on the demo's requests:
        ``results/speculative_early_exit_page4.md`` and
        ``results/speculative_early_exit.md``).

    Raises:
      ValueError: neither or both of ``model`` and ``num_layers``, a model
        without ``params``, ``apply`` and ``make_kv_pool``, or
        ``num_layers`` / ``kv_tokens`` / ``page_size`` not an int >= 1
        (checked against the target when an engine is built).
    """

    model: Any = None
    num_layers: int | None = None
    kv_tokens: int | None = None
    page_size: int | None = None

    def __post_init__(self):
        if (self.model is None) == (self.num_layers is None):
            raise ValueError(f"DraftModel needs one of model (a separate draft) and num_layers (the target's first "
                             f"layers), got model={self.model!r:.60} num_layers={self.num_layers!r}")
        if self.num_layers is not None:
            object.__setattr__(self, "num_layers", check_int("num_layers", self.num_layers))
        if self.model is not None and not (hasattr(self.model, "params") and all(
                callable(getattr(self.model, f, None)) for f in ("apply", "make_kv_pool"))):
            raise ValueError(f"DraftModel's model must have params, apply(params, batch, kv) and "
                             f"make_kv_pool(num_pages, page_size, dtype) (models.ragged.RaggedModel), got a "
                             f"{type(self.model).__name__}")
        for name in ("kv_tokens", "page_size"):  # slot ids are int32
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), 1, 2**31))

    def __repr__(self) -> str:
        what = f"num_layers={self.num_layers}" if self.model is None else f"model={type(self.model).__name__}"
        return f"DraftModel({what}, kv_tokens={self.kv_tokens}, page_size={self.page_size})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding in the engine.

    Each call, a running sequence that decodes asks ``proposer`` for up to
    ``num_speculative_tokens`` tokens (fewer near its ``max_new_tokens``);
    the call computes them after its last token as one row of query
    tokens, the target's logits at each row verify them
    (:func:`paged_jax.engine.sampling.verify_proposals`), and the pages of
    the rejected ones go back at once
    (:func:`paged_jax.paging.page_state.truncate`).

    Which sequences never speculate (they decode one token a call, as
    without it): beam search (vLLM refuses it too: each beam step chooses
    among the beams' candidates on the host), requests asking for
    ``logprobs`` (reported per sampled token), and a sequence before its
    first token (its parallel samples fork from the call that samples
    it). While sequences may propose, every call is read before the next
    is dispatched (``async_scheduling`` waits: a sequence's next proposals
    follow from the tokens this call kept); at or above
    ``disable_by_batch_size`` running sequences calls stay in flight as
    without speculation.

    Attributes:
      num_speculative_tokens: most tokens proposed per sequence and call,
        in ``[1, MAX_SPECULATIVE_TOKENS]``.
      proposer: what proposes them (default: n-gram prompt lookup,
        :class:`paged_jax.speculative.proposers.NgramProposer` with
        ``min_n=2, max_n=4``), or a :class:`DraftModel`, which each engine
        runs in a draft engine of its own.
      disable_by_batch_size: no sequence proposes in a call while at
        least this many sequences run (vLLM v0's
        ``speculative_disable_by_batch_size``): a large batch is bound by
        compute, where every proposed token costs what a decoded one does
        and a rejected one buys nothing; None (the default): always.

    Raises:
      ValueError: ``num_speculative_tokens`` out of range,
        ``disable_by_batch_size`` not None or an int >= 1, or a
        ``proposer`` that is neither a :class:`DraftModel` nor has
        ``propose(token_ids, k)`` (an instance, not its class).
    """

    num_speculative_tokens: int = 4
    proposer: Proposer | DraftModel = dataclasses.field(default_factory=lambda: NgramProposer(2, 4))
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "num_speculative_tokens", check_int(
            "num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS + 1))
        if self.disable_by_batch_size is not None:
            object.__setattr__(self, "disable_by_batch_size", check_int("disable_by_batch_size",
                                                                        self.disable_by_batch_size))
        if not isinstance(self.proposer, DraftModel) and (
                isinstance(self.proposer, type) or not callable(getattr(self.proposer, "propose", None))):
            raise ValueError(f"proposer must have propose(token_ids, k) -> list[int] "
                             f"(paged_jax.speculative.proposers.Proposer), got {self.proposer!r:.80}")

    @classmethod
    def ngram(cls, num_speculative_tokens: int = 4, min_n: int = 2, max_n: int = 4,
              disable_by_batch_size: int | None = None) -> SpeculativeConfig:
        """Prompt lookup (vLLM's ``method="ngram"``, ``prompt_lookup_min``
        = ``min_n``, ``prompt_lookup_max`` = ``max_n``)."""
        return cls(num_speculative_tokens=num_speculative_tokens, proposer=NgramProposer(min_n, max_n),
                   disable_by_batch_size=disable_by_batch_size)


    @classmethod
    def draft(cls, num_speculative_tokens: int = 4, *, model=None, num_layers: int | None = None,
              kv_tokens: int | None = None, page_size: int | None = None,
              disable_by_batch_size: int | None = None) -> SpeculativeConfig:
        """A draft model's greedy tokens (vLLM's ``method="draft_model"``):
        a separate ``model``, or the target's first ``num_layers`` blocks
        (early exit); :class:`DraftModel`."""
        return cls(num_speculative_tokens=num_speculative_tokens,
                   proposer=DraftModel(model=model, num_layers=num_layers, kv_tokens=kv_tokens, page_size=page_size),
                   disable_by_batch_size=disable_by_batch_size)


SPECULATIVE_METHODS = ("none", "ngram", "early-exit")
"""``--speculative``'s choices (:func:`add_speculative_flags`)."""

DEFAULT_DRAFT_LAYERS = 8
"""``--draft-layers``' default: SmolLM2-135M's first 8 of 30 layers
(``results/speculative_early_exit.md``)."""


def add_speculative_flags(parser) -> None:
    """Adds the ``--speculative`` family of flags to an
    ``argparse.ArgumentParser`` (the scripts' and the server's):
    ``--speculative {none,ngram,early-exit}``, ``--num-speculative-tokens``,
    ``--ngram-min``, ``--ngram-max`` and ``--speculative-disable-by-batch-size``
    (vLLM's ``num_speculative_tokens``, ``prompt_lookup_min``,
    ``prompt_lookup_max`` and ``speculative_disable_by_batch_size``) and
    ``--draft-layers`` and ``--draft-page-size`` (``--speculative
    early-exit``: the model's first layers as the draft,
    :class:`DraftModel`); read them back with
    :func:`speculative_from_args`."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative", choices=SPECULATIVE_METHODS, default="none",
                       help="propose tokens for the model to verify in one call: ngram is prompt lookup, "
                            "early-exit the model's first --draft-layers layers as a draft (default %(default)s)")
    group.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                       help="most tokens proposed per sequence and call (default %(default)s)")
    group.add_argument("--ngram-min", type=int, default=2, metavar="N",
                       help="ngram: shortest suffix n-gram looked up (default %(default)s)")
    group.add_argument("--ngram-max", type=int, default=4, metavar="N",
                       help="ngram: longest suffix n-gram looked up (default %(default)s)")
    group.add_argument("--draft-layers", type=int, default=DEFAULT_DRAFT_LAYERS, metavar="N",
                       help="early-exit: the model's first N layers propose (default %(default)s)")
    group.add_argument("--draft-page-size", type=int, default=None, metavar="L",
                       help="early-exit: tokens per page of the draft's pool (default: the model's page size)")
    group.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                       help="no proposals while at least N sequences run (default: always propose)")


def speculative_from_args(parser, args) -> SpeculativeConfig | None:
    """The :class:`SpeculativeConfig` the flags of :func:`add_speculative_flags`
    ask for (None for ``--speculative none``); a bad value exits through
    ``parser.error`` naming its flag."""
    try:  # checked whatever --speculative says: a bad value is a mistake either way
        config = SpeculativeConfig.ngram(args.num_speculative_tokens, args.ngram_min, args.ngram_max,
                                         args.speculative_disable_by_batch_size)
        early = SpeculativeConfig.draft(args.num_speculative_tokens, num_layers=args.draft_layers,
                                        page_size=args.draft_page_size,
                                        disable_by_batch_size=args.speculative_disable_by_batch_size)
        return {"none": None, "ngram": config, "early-exit": early}[args.speculative]
    except ValueError as e:
        flag = {"num_speculative_tokens": "--num-speculative-tokens", "min_n": "--ngram-min",
                "max_n": "--ngram-max", "disable_by_batch_size": "--speculative-disable-by-batch-size",
                "num_layers": "--draft-layers", "page_size": "--draft-page-size"}
        name = next((f for k, f in flag.items() if str(e).startswith(k)), "--speculative")
        parser.error(f"{name}: {e}")
