"""The FastAPI app: routes, API key, errors in OpenAI's shape, disconnects.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (:mod:`server.openai_serving`), ``GET /health``,
``GET /metrics`` (:mod:`server.metrics`) and ``POST /reset_prefix_cache``
(vLLM's: no later request hits K/V computed before it; benchmarks call it
between runs).

Every error is an OpenAI error object, ``{"error": {"message", "type",
"param", "code"}}``: malformed JSON, a field of the wrong type (pydantic's
refusal, which FastAPI would answer with a 422, is a 400 here, as OpenAI
answers), unknown routes (404) included. With an API key, ``/v1/*`` and
``/reset_prefix_cache`` need ``Authorization: Bearer KEY`` (401
otherwise), as vLLM's ``--api-key``; ``/health`` and ``/metrics`` stay open
to probes and scrapers.

Bounds (:mod:`server.limits`): a body past the bound is a 413 while it
streams in, a ``Content-Type`` other than JSON a 415 before it is read, an
integer of more than 20 digits or a field past its bound a 400 naming
it.

Why bodies are parsed by hand rather than by FastAPI: a body that is not
JSON and one whose field has the wrong type are different mistakes, and the
error should say which, naming the field (:func:`server.protocol.validation_error`).

A client that disconnects: a streamed response's generator is cancelled by
Starlette, which aborts its requests (:class:`server.engine_loop.RequestStream`);
a plain one is watched for ``http.disconnect`` while it waits, and its
handler cancelled, which aborts them too. Either way their pages go back
to the pool at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from models.llm import LLM
from paged_jax.checks import check_instance
from server.engine_loop import EngineLoop
from server.limits import BodyLimit, RequestLimits, load_json
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, shown, validation_error
from server.timing import RequestTimes, TimingRecorder, stamp_first_chunk

CLIENT_CLOSED = 499
"""The status logged for a request whose client went away before the
answer (nginx's convention; the client never sees it)."""


def build_app(llm: LLM, *, model_name: str | None = None, api_key: str | None = None,
              timing: TimingRecorder | None = None, limits: RequestLimits | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``llm``'s engine.

    The engine loop (:class:`server.engine_loop.EngineLoop`) starts with
    the app (its lifespan) and stops with it; from then on only the loop's
    thread touches ``llm.engine``: use ``app.state.engine_loop.call(fn)``
    to run code on it.

    Args:
      llm: the model and engine (:class:`models.llm.LLM`); its engine must
        have no unfinished requests.
      model_name: the name clients send as ``model`` (default ``llm.name``).
      api_key: if given, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
      timing: records where each completion request's time goes
        (:mod:`server.timing`; benchmarks); None records nothing.
      limits: the bounds on a request (:class:`server.limits.RequestLimits`);
        default :meth:`~server.limits.RequestLimits.for_context` of the
        engine's ``max_seq_len`` and the tokenizer.

    Returns:
      the app; ``app.state`` holds ``engine_loop``, ``metrics``
      (:class:`server.metrics.ServerMetrics`), ``model_name``, ``timing``
      and ``limits``.

    Raises:
      ValueError: ``llm`` is not an LLM, its engine is busy, or
        ``model_name`` / ``api_key`` is not a non-empty str, or ``timing``
        is not a TimingRecorder, or ``limits`` not a RequestLimits.
    """
    check_instance("llm", llm, LLM, what="models.llm.LLM")
    if timing is not None:
        check_instance("timing", timing, TimingRecorder, what="server.timing.TimingRecorder")
    if limits is None:
        limits = RequestLimits.for_context(llm.engine.config.max_seq_len, vocab_size=llm.engine.vocab_size,
                                           token_floor=None if llm.tokenizer is None else llm.tokenizer.token_floor)
    check_instance("limits", limits, RequestLimits, what="server.limits.RequestLimits")
    model_name = llm.name if model_name is None else model_name
    for name, value in (("model_name", model_name), ("api_key", api_key)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty str, got {name}={value!r}")
    # Each needs the other: the metrics read the loop's snapshots, the loop reports outputs to the metrics.
    metrics = ServerMetrics(lambda: engine_loop.snapshot(), model_name)
    engine_loop = EngineLoop(llm.engine, on_output=metrics.observe)
    serving = OpenAIServing(engine_loop, model_name=model_name, tokenizer=llm.tokenizer,
                            max_seq_len=llm.engine.config.max_seq_len, max_seqs=llm.engine.config.max_seqs,
                            limits=limits)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(title="paged-jax", description="OpenAI-compatible server over the paged-jax engine",
                  lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.timing = timing
    app.state.limits = limits
    app.add_middleware(BodyLimit, max_body_bytes=limits.max_body_bytes)
    _install_error_handlers(app)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "paged-jax", "root": llm.name,
            "max_model_len": llm.engine.config.max_seq_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        times = None if timing is None else timing.begin()
        body = await _parse(request, CompletionRequest)
        return await _respond(request, serving.completions(body), times)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        times = None if timing is None else timing.begin()
        body = await _parse(request, ChatCompletionRequest)
        return await _respond(request, serving.chat(body), times)

    app.include_router(v1)

    @app.post("/reset_prefix_cache", dependencies=[Depends(authorize)])
    async def reset_prefix_cache() -> dict:
        pages = await asyncio.wrap_future(engine_loop.call(lambda engine: engine.reset_prefix_cache()))
        return {"pages_forgotten": pages}

    @app.get("/health")
    async def health():
        if engine_loop.alive:
            return {"status": "ok"}
        why = engine_loop.failed
        message = "the engine loop is not running" if why is None else f"the engine failed: {why}"
        return JSONResponse(APIError(503, message, type="server_error", code="engine_dead").body(), 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


JSON_MEDIA_TYPE = "application/json"


async def _parse(request: Request, model: type[pydantic.BaseModel]):
    """The body as ``model``, or an :class:`APIError`: 415 for a
    ``Content-Type`` other than JSON (a web page may send ``text/plain`` to
    a server on localhost without a CORS preflight, so such a body is not
    read at all), 413 past the body bound (:class:`server.limits.BodyLimit`),
    400 for what is not JSON, not an object, or a field pydantic refuses."""
    content_type = request.headers.get("content-type")
    if content_type is None or content_type.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        got = "none" if content_type is None else shown(content_type)
        raise APIError(415, f"Content-Type must be {JSON_MEDIA_TYPE} (a charset may follow), got {got}",
                       code="unsupported_media_type")
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        raise APIError(CLIENT_CLOSED, "the client disconnected before sending its whole body") from None
    try:
        data = load_json(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:  # a lone UTF-16 surrogate ("\\ud800") is valid JSON but not text: no tokenizer can take it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"the request body holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}), which is "
                          "not text") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


async def _respond(request: Request, handler, times: RequestTimes | None = None):
    """Runs ``handler`` (a coroutine giving a dict or an async iterator of
    SSE events) until it answers or the client disconnects; in the second
    case cancels it (which aborts its requests). ``times``: the request's
    :mod:`server.timing` record, stamped ``parsed`` now and ``first_chunk``
    when its stream writes the first token."""
    if times is not None:
        times.stamp("parsed")
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=CLIENT_CLOSED)
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    if times is not None:
        result = stamp_first_chunk(result, times)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the
    next ASGI message can only be ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(bad_request(f"{param}: {first.get('msg', 'invalid request')}", param).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return JSONResponse(APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")
                            .body(), 500)
