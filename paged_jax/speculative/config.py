"""How an engine speculates: its proposer and how many tokens a sequence
proposes per call (``EngineConfig.speculative``).

vLLM's ``speculative_config`` (``method="ngram"``,
``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max``)
is :meth:`SpeculativeConfig.ngram`; a researcher's own proposer is any
:class:`paged_jax.speculative.proposers.Proposer` passed as ``proposer``.
"""

from __future__ import annotations

import dataclasses

from paged_jax.checks import check_int
from paged_jax.speculative.proposers import NgramProposer, Proposer

MAX_SPECULATIVE_TOKENS = 64
"""Most tokens a sequence may propose per call: each is a query token of
the call and a slot of its pages reserved ahead."""


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
        ``min_n=2, max_n=4``).
      disable_by_batch_size: no sequence proposes in a call while at
        least this many sequences run (vLLM v0's
        ``speculative_disable_by_batch_size``): a large batch is bound by
        compute, where every proposed token costs what a decoded one does
        and a rejected one buys nothing; None (the default): always.

    Raises:
      ValueError: ``num_speculative_tokens`` out of range,
        ``disable_by_batch_size`` not None or an int >= 1, or a
        ``proposer`` without ``propose(token_ids, k)`` (an instance, not
        its class).
    """

    num_speculative_tokens: int = 4
    proposer: Proposer = dataclasses.field(default_factory=lambda: NgramProposer(2, 4))
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "num_speculative_tokens", check_int(
            "num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS + 1))
        if self.disable_by_batch_size is not None:
            object.__setattr__(self, "disable_by_batch_size", check_int("disable_by_batch_size",
                                                                        self.disable_by_batch_size))
        if isinstance(self.proposer, type) or not callable(getattr(self.proposer, "propose", None)):
            raise ValueError(f"proposer must have propose(token_ids, k) -> list[int] "
                             f"(paged_jax.speculative.proposers.Proposer), got {self.proposer!r:.80}")

    @classmethod
    def ngram(cls, num_speculative_tokens: int = 4, min_n: int = 2, max_n: int = 4,
              disable_by_batch_size: int | None = None) -> SpeculativeConfig:
        """Prompt lookup (vLLM's ``method="ngram"``, ``prompt_lookup_min``
        = ``min_n``, ``prompt_lookup_max`` = ``max_n``)."""
        return cls(num_speculative_tokens=num_speculative_tokens, proposer=NgramProposer(min_n, max_n),
                   disable_by_batch_size=disable_by_batch_size)


SPECULATIVE_METHODS = ("none", "ngram")
"""``--speculative``'s choices (:func:`add_speculative_flags`)."""


def add_speculative_flags(parser) -> None:
    """Adds the ``--speculative`` family of flags to an
    ``argparse.ArgumentParser`` (the scripts' and the server's):
    ``--speculative {none,ngram}``, ``--num-speculative-tokens``,
    ``--ngram-min``, ``--ngram-max`` and ``--speculative-disable-by-batch-size``
    (vLLM's ``num_speculative_tokens``, ``prompt_lookup_min``,
    ``prompt_lookup_max`` and ``speculative_disable_by_batch_size``); read them back with
    :func:`speculative_from_args`."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative", choices=SPECULATIVE_METHODS, default="none",
                       help="propose tokens for the model to verify in one call: ngram is prompt lookup "
                            "(default %(default)s)")
    group.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                       help="most tokens proposed per sequence and call (default %(default)s)")
    group.add_argument("--ngram-min", type=int, default=2, metavar="N",
                       help="ngram: shortest suffix n-gram looked up (default %(default)s)")
    group.add_argument("--ngram-max", type=int, default=4, metavar="N",
                       help="ngram: longest suffix n-gram looked up (default %(default)s)")
    group.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                       help="no proposals while at least N sequences run (default: always propose)")


def speculative_from_args(parser, args) -> SpeculativeConfig | None:
    """The :class:`SpeculativeConfig` the flags of :func:`add_speculative_flags`
    ask for (None for ``--speculative none``); a bad value exits through
    ``parser.error`` naming its flag."""
    try:  # checked whatever --speculative says: a bad value is a mistake either way
        config = SpeculativeConfig.ngram(args.num_speculative_tokens, args.ngram_min, args.ngram_max,
                                         args.speculative_disable_by_batch_size)
        return None if args.speculative == "none" else config
    except ValueError as e:
        flag = {"num_speculative_tokens": "--num-speculative-tokens", "min_n": "--ngram-min",
                "max_n": "--ngram-max", "disable_by_batch_size": "--speculative-disable-by-batch-size"}
        name = next((f for k, f in flag.items() if str(e).startswith(k)), "--speculative")
        parser.error(f"{name}: {e}")
