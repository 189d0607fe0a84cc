"""server.engine_loop: a burst of submissions to an idle engine starts in
one step (EngineLoop._settle), a lone one starts its own first call, and
stopping ends the open streams."""

import asyncio

import pytest
from engine_helpers import make_engine, toy_requests

from paged_jax.engine.core import Request, SamplingParams
from server.engine_loop import EngineDeadError, EngineLoop, admit


async def _serve(engine_loop: EngineLoop, requests, delays) -> None:
    async def one(request, hops):
        for _ in range(hops):  # a handler's own hand-offs before it submits (body, tokenizer, checks)
            await asyncio.sleep(0)
        stream = await admit(engine_loop, [request])
        async for out in stream:
            if out.finished:
                return

    await asyncio.gather(*(one(r, h) for r, h in zip(requests, delays)))


def _first_call_tokens(requests, delays) -> tuple[int, int]:
    engine = make_engine(budget=256, max_seqs=8)
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    try:
        asyncio.run(_serve(engine_loop, requests, delays))
    finally:
        engine_loop.stop()
    return engine.stats.calls[0].tokens, sum(len(r.prompt_ids) for r in requests)


def test_a_burst_to_an_idle_engine_is_prefilled_in_one_call():
    requests = toy_requests(6, max_new=(2, 4), prompt_len=(5, 20))
    first, prompts = _first_call_tokens(requests, delays=[0, 1, 2, 3, 2, 1])
    assert first == prompts  # every prompt of the burst in the first call, none a step late


def test_a_lone_request_starts_its_own_first_call():
    [request] = toy_requests(1, max_new=(3, 4), prompt_len=(5, 6))
    first, prompts = _first_call_tokens([request], delays=[0])
    assert first == prompts


def test_stopping_ends_the_open_streams_with_the_shutdown_error_and_frees_their_pages():
    """What Ctrl-C does to `python -m server` (server.__main__._Server):
    stop_soon ends every open stream at once with EngineDeadError (it
    used to leave them waiting: the abort forgot their sinks before they
    were failed), and their requests' pages go back to the pool."""
    engine = make_engine(max_seqs=4, max_seq_len=1024, num_pages=600)  # 900 steps: far from done when stopped
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    requests = [Request(request_id=i, prompt_ids=[1, 2, 3, 4 + i], max_new_tokens=900,
                        sampling=SamplingParams(output_kind="delta")) for i in range(2)]  # as the server streams

    async def serve():
        stream = await admit(engine_loop, requests)
        seen = 0
        with pytest.raises(EngineDeadError, match="the server is shutting down"):
            async for out in stream:
                seen += 1
                if seen == 2:
                    engine_loop.stop_soon()
        return seen

    try:
        seen = asyncio.run(asyncio.wait_for(serve(), timeout=60))
    finally:
        engine_loop.stop()
    assert 2 <= seen < 2 * 900 and not engine.has_unfinished()
    assert engine.accounting()["used"] == 0


def test_what_is_submitted_just_after_a_stop_fails_rather_than_waits():
    """A submit or call queued behind the stop, taken in the same batch of
    commands, is answered with EngineDeadError (it once waited for ever)."""
    engine_loop = EngineLoop(make_engine(max_seqs=4))
    engine_loop.start()
    try:
        engine_loop.stop_soon()
        call = engine_loop.call(lambda e: 42)
        with pytest.raises(EngineDeadError, match="shutting down"):
            call.result(timeout=30)

        async def submit():
            await admit(engine_loop, toy_requests(1))

        with pytest.raises(EngineDeadError, match="shutting down"):
            asyncio.run(asyncio.wait_for(submit(), timeout=30))
    finally:
        engine_loop.stop()
    assert not engine_loop.alive
