"""Output processing, outside the engine's loop: a finished group's
:class:`~paged_jax.requests.RequestOutput`, and stepping an engine until it
has no work (vLLM keeps its output processor outside the scheduler loop for
the same reason: what a request returns is not the loop's concern)."""

from __future__ import annotations

from tqdm.auto import tqdm

from paged_jax import beam_search
from paged_jax.requests import CompletionOutput, RequestOutput
from paged_jax.sequence import SequenceGroup


def request_output(group: SequenceGroup, *, finish_s: float) -> RequestOutput:
    """What ``group`` returns: its sequences' tokens, or for beam search its
    ``beam_width`` best hypotheses (and, if aborted, the beams still
    searching), best first. ``finish_s``: seconds from the engine's start."""
    if group.beam:
        outputs = [CompletionOutput(index=i, output_ids=h.output_ids, finish_reason=h.finish_reason,
                                    cumulative_logprob=h.cum_logprob)
                   for i, h in enumerate(beam_search.best_hypotheses(group))]
    else:
        outputs = [CompletionOutput(index=s.index, output_ids=s.tokens[s.num_prompt :], finish_reason=s.finish_reason)
                   for s in group.seqs]
    first = group.seqs[0]
    return RequestOutput(
        request_id=group.request.request_id,
        prompt_ids=first.tokens[: first.num_prompt],
        outputs=outputs,
        num_preemptions=group.num_preemptions,
        first_token_s=group.first_token_s,
        finish_s=finish_s,
        num_cached_tokens=group.num_cached_tokens or 0,
    )


def drain(engine, total: int, progress: bool, postfix=None) -> list[RequestOutput]:
    """Steps ``engine`` (an :class:`Engine` or anything with ``step()`` and
    ``has_unfinished()``) until it has no work; returns the outputs in the
    order they finished. ``progress`` shows a bar of ``total`` requests
    (none when stderr is not a terminal), with ``postfix()``'s fields."""
    bar = tqdm(total=total, unit="req", leave=False, disable=None) if progress else None
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        done = engine.step()
        outputs.extend(done)
        if bar is not None:
            bar.update(len(done))
            if postfix is not None:
                bar.set_postfix(**postfix())
    if bar is not None:
        bar.close()
    return outputs
