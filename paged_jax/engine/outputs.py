"""Output processing, outside the engine's loop: a finished group's
:class:`~paged_jax.engine.requests.RequestOutput`, and stepping an engine until it
has no work (vLLM keeps its output processor outside the scheduler loop for
the same reason: what a request returns is not the loop's concern)."""

from __future__ import annotations

from tqdm.auto import tqdm

from paged_jax.engine import beam_search
from paged_jax.engine.prompt_logprobs import PromptLogprobsBook
from paged_jax.engine.requests import CompletionOutput, RequestOutput
from paged_jax.engine.sequence import Sequence, SequenceGroup


def request_output(group: SequenceGroup, *, now: float, finished: bool, decode=None,
                   prompt_book: PromptLogprobsBook | None = None) -> RequestOutput:
    """What ``group`` reports now, by its ``SamplingParams.output_kind``:
    everything so far ("final", "cumulative") or what is new since its last
    report ("delta": only the sequences with news). Marks what it reports
    as reported.

    Args:
      now: engine-clock seconds (``finish_s`` when ``finished``).
      finished: the request has ended (every sequence finished, or aborted).
      decode: ``decode(prompt_ids, output_ids, skip_special_tokens) -> str
        | None``, beam search hypotheses' text; None for no text.
      prompt_book: the engine's prompt log-prob records (a request asking
        for them reports them; a finished one's record is dropped).

    Beam search reports its ``beam_width`` best hypotheses (and, if aborted,
    the beams still searching), best first, once, when finished.
    """
    delta = group.request.sampling.output_kind == "delta" and not group.beam  # beam search reports once
    if group.beam:
        skip, prompt = group.request.sampling.skip_special_tokens, group.seqs[0].tokens[: group.seqs[0].num_prompt]
        outputs = [CompletionOutput(index=i, output_ids=h.output_ids, finish_reason=h.finish_reason,
                                    cumulative_logprob=h.cum_logprob,
                                    text=None if decode is None else decode(prompt, h.output_ids, skip),
                                    token_times=group.step_times[: len(h.output_ids)])
                   for i, h in enumerate(beam_search.best_hypotheses(group))]
    else:
        outputs = [_completion(s, delta) for s in group.seqs
                   if not delta or s.num_generated > s.num_reported or (s.done and not s.final_reported)]
    first = group.seqs[0]
    return RequestOutput(
        request_id=group.request.request_id,
        prompt_ids=first.tokens[: first.num_prompt],
        outputs=outputs,
        num_preemptions=group.num_preemptions,
        first_token_s=group.first_token_s,
        finish_s=now if finished else None,
        num_cached_tokens=group.num_cached_tokens or 0,
        num_host_cached_tokens=group.num_host_cached_tokens,
        num_disk_cached_tokens=group.num_disk_cached_tokens,
        num_remote_cached_tokens=group.num_remote_cached_tokens,
        finished=finished,
        arrival_s=group.arrival_s,
        prompt_logprobs=None if prompt_book is None else prompt_book.report(group, delta=delta, final=finished),
    )


def _completion(seq: Sequence, delta: bool) -> CompletionOutput:
    """``seq``'s output: all of it, or (``delta``) what is new since its
    last report; its text held back where a stop string may still begin."""
    start = seq.num_reported if delta else 0
    seq.num_reported = seq.num_generated
    seq.final_reported = seq.done
    text = None
    if seq.detok is not None:
        new_text = seq.detok.take_delta(seq.done)
        seq.text_out += new_text
        text = new_text if delta else seq.text_out
    return CompletionOutput(
        index=seq.index,
        output_ids=seq.tokens[seq.num_prompt + start :],
        finish_reason=seq.finish_reason if seq.done else None,
        cumulative_logprob=seq.cum_logprob if seq.logprobs is not None else None,
        text=text,
        token_times=seq.token_times[start:],
        logprobs=None if seq.logprobs is None else seq.logprobs[start:],
        stop_reason=seq.stop_reason,
        num_proposed_tokens=seq.num_proposed,
        num_accepted_tokens=seq.num_accepted,
    )


def drain(engine, total: int, progress: bool, postfix=None) -> list[RequestOutput]:
    """Steps ``engine`` (an :class:`Engine` or anything with ``step()`` and
    ``has_unfinished()``) until it has no work; returns the finished outputs
    in the order they finished (streamed partial outputs are dropped; a
    "delta" request's final output then holds only its last delta). ``progress`` shows a bar of ``total`` requests
    (none when stderr is not a terminal), with ``postfix()``'s fields."""
    bar = tqdm(total=total, unit="req", leave=False, disable=None) if progress else None
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        done = [o for o in engine.step() if o.finished]
        outputs.extend(done)
        if bar is not None:
            bar.update(len(done))
            if postfix is not None:
                bar.set_postfix(**postfix())
    if bar is not None:
        bar.close()
    return outputs
