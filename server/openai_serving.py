"""The completions and chat completions endpoints: an OpenAI request in,
engine requests out, their streamed outputs back as OpenAI responses.

Each HTTP request becomes one engine :class:`paged_jax.engine.requests.Request`
per prompt (a batch of prompts gives several; chat gives one), each asking
for ``n`` choices; choice ``i * n + j`` is prompt ``i``'s sample ``j``, as
OpenAI and vLLM number them. Every engine request streams deltas
(``SamplingParams.output_kind="delta"``): the engine detokenizes and cuts
stop strings (:mod:`paged_jax.engine.detokenizer`), this module only formats.

Echo. ``echo`` with ``logprobs`` asks the engine for the prompt's
log-probabilities (``SamplingParams.prompt_logprobs``, the same ``k``) and
puts the prompt before each choice. ``max_tokens: 0`` with echo scores the
prompt alone (lm-eval-harness' ``loglikelihood``): the engine cannot finish
a request without an output token (every request ends on the token that
reaches ``max_new_tokens`` or stops it), so it generates one, whose logits
the prompt's last row computes anyway, and this module drops it, as vLLM
does (``max_tokens=1`` when ``echo_without_generation`` in
``vllm/entrypoints/openai/protocol.py``).

Why the length checks happen here and again in the engine: the engine's
message names its own request id and ``max_new_tokens``; the client sent
``prompt`` and ``max_tokens``, so the common cases are worded in the
client's terms before the engine sees them. What only the engine knows
(the pool holding ``n`` sequences) comes back as its ``ValueError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from paged_jax.checks import check_float, check_int, is_int
from paged_jax.engine.core import Request
from paged_jax.engine.detokenizer import IncrementalDetokenizer, as_tokenizer, prompt_text
from paged_jax.engine.requests import CompletionOutput, RequestOutput
from paged_jax.engine.sampling import SamplingParams
from server.engine_loop import EngineDeadError, EngineLoop, RequestStream, admit
from server.limits import RequestLimits
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, clip, shown

DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of a completion request that gives none (OpenAI's default)."""

MAX_TEMPERATURE = 2.0
"""The highest ``temperature`` accepted (OpenAI's bound)."""

LOGPROB_FLOOR = -9999.0
"""A log-probability of -inf as JSON can carry it (vLLM's choice)."""


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj) -> str:
    """One server-sent event: ``data: {...}\\n\\n``."""
    return f"data: {_json(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _Choice:
    """What one choice has so far (text, ids, log-probs, how it ended)."""

    __slots__ = ("index", "text", "ids", "logprobs", "finish_reason", "stop_reason")

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason = None


class OpenAIServing:
    """Turns OpenAI requests into engine requests and their outputs back.

    Args:
      engine_loop: the loop that owns the engine.
      model_name: the name clients must send as ``model``.
      tokenizer: a :class:`models.tokenizer.Tokenizer`, or None (a
        random-weight preset: token-id prompts only, no chat, no stop
        strings, empty text).
      max_seq_len: the engine's most tokens per sequence.
      max_seqs: the engine's most running sequences (``n`` at most this).
      limits: the bounds on a request's fields (:class:`server.limits.RequestLimits`).
    """

    def __init__(self, engine_loop: EngineLoop, *, model_name: str, tokenizer, max_seq_len: int, max_seqs: int,
                 limits: RequestLimits):
        self.loop = engine_loop
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.max_seqs = max_seqs
        self.limits = limits
        self.vocab_size = engine_loop.engine.vocab_size  # read once, before the loop owns the engine
        self._token_text: dict[int, str] = {}

    # --------------------------------------------------------------- endpoints

    async def completions(self, req: CompletionRequest):
        """A response dict, or (``stream``) an async iterator of SSE
        strings. Raises :class:`APIError` for anything refused."""
        self._check_common(req)
        prompts = await asyncio.to_thread(self._prompt_ids, req.prompt)  # a long text must not stall other clients
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        self._check_lengths(prompts, max_tokens, "max_tokens", "prompt", least=0 if req.echo else 1)
        sampling = self._sampling(req, logprobs=req.logprobs, prompt_logprobs=req.logprobs if req.echo else None)
        echo = None
        if req.echo:  # a prompt sent as text comes back as sent; token ids as their text before the output's
            echo = [p if isinstance(p, str) else prompt_text(self.tokenizer, ids) if self.tokenizer else ""
                    for p, ids in zip(_split(req.prompt)[0], prompts)]
        return await self._run(req, prompts, max_tokens, sampling, chat=False, echo=echo)

    async def chat(self, req: ChatCompletionRequest):
        """As :meth:`completions`, for ``/v1/chat/completions``."""
        self._check_common(req)
        if self.tokenizer is None:
            raise bad_request(f"model {self.model_name!r} has no tokenizer (random weights): chat needs one; send "
                              "token ids to /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        for i, m in enumerate(messages):  # a template puts each message's text in the prompt
            self._check_fits(f"messages[{i}].content", m["content"], "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (raise_exception, TemplateError)
            raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
        self._check_fits("messages (rendered with the chat template)", text, "messages")
        ids = await asyncio.to_thread(self.tokenizer.encode, text)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        given, name = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                       else (req.max_tokens, "max_tokens"))
        if given is None:
            if len(ids) >= self.max_seq_len:
                self._check_lengths([ids], 1, "max_tokens", "messages")
            given = self.max_seq_len - len(ids)
        self._check_lengths([ids], given, name, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sampling = self._sampling(req, logprobs=logprobs, logprobs_name="top_logprobs")
        return await self._run(req, [ids], given, sampling, chat=True)

    # ------------------------------------------------------------------ checks

    def _check_common(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model `{clip(req.model)}` does not exist.", param="model",
                           code="model_not_found")
        self.limits.check(req)
        for name, why in req.unsupported():
            raise bad_request(f"{name}: {why}", name)
        if req.stream_options is not None and not req.stream:  # vLLM's check and words
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        if req.cache_salt is not None and not req.cache_salt:  # a salt of '' would share pages with no salt's
            raise bad_request("cache_salt must be a non-empty str when given, got cache_salt=''", "cache_salt")

    def _prompt_ids(self, prompt) -> list[list[int]]:
        """Each prompt's ids (one prompt, or a batch)."""
        prompts, names = _split(prompt)
        if not prompts:
            raise bad_request("prompt is empty; need at least one token", "prompt")
        if self.tokenizer is not None:  # every text first: none is tokenized when one cannot fit
            for name, p in zip(names, prompts):
                if isinstance(p, str):
                    self._check_fits(name, p, "prompt")
        out = []
        for name, p in zip(names, prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise bad_request(f"{name} is text, but model {self.model_name!r} has no tokenizer (random "
                                      "weights): send token ids", "prompt")
                ids = self.tokenizer.encode(p)
            else:
                ids = list(p)
                bad = next((j for j, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
                if bad is not None:  # named here: the engine's message cannot say which prompt of a batch
                    raise bad_request(f"{name}[{bad}]={shown(ids[bad])} is not a token id: the vocabulary has "
                                      f"{self.vocab_size} ids, [0, {self.vocab_size})", "prompt")
            if not ids:
                raise bad_request(f"{name} is empty; need at least one token", "prompt")
            out.append(ids)
        return out

    def _check_fits(self, name: str, text: str, param: str) -> None:
        """Refuses ``text`` (a prompt, a message) whose fewest possible
        tokens (:meth:`models.tokenizer.Tokenizer.fewest_tokens`, no
        tokenizing) already fill the context."""
        fewest = self.tokenizer.fewest_tokens(text)
        if fewest >= self.max_seq_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_seq_len} tokens (prompt plus output); {name} is "
                f"{len(text)} characters, which take at least {fewest} tokens (one token covers at most "
                f"{self.tokenizer.token_floor.max_token_bytes} bytes of UTF-8), got {shown(text)}", param)

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int, tokens_name: str, prompt_name: str,
                       least: int = 1) -> None:
        _door(check_int, tokens_name, max_tokens, least)
        for ids in prompts:
            if len(ids) >= self.max_seq_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_seq_len} tokens (prompt plus output); the "
                    f"prompt has {len(ids)} tokens, leaving no room for output", prompt_name)
            if len(ids) + max_tokens > self.max_seq_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_seq_len} tokens; you requested "
                    f"{shown(len(ids) + max_tokens)} tokens ({len(ids)} in the prompt, {shown(max_tokens)} for the "
                    "completion). "
                    f"Reduce {tokens_name} to at most {self.max_seq_len - len(ids)}", tokens_name)

    def _sampling(self, req, *, logprobs: int | None, logprobs_name: str = "logprobs",
                  prompt_logprobs: int | None = None) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        _door(check_float, "temperature", temperature, 0, MAX_TEMPERATURE)
        if req.n > self.max_seqs:
            raise bad_request(f"n must be at most {self.max_seqs} (the server's most running sequences), got "
                              f"n={shown(req.n)}", "n")
        # Unseeded sampling draws a fresh seed: seed 0 for everyone would give every client the same samples.
        seed = req.seed if req.seed is not None else (secrets.randbits(32) if temperature > 0 else 0)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
        if stop and self.tokenizer is None:
            raise bad_request(f"stop strings need a tokenizer; model {self.model_name!r} has none", "stop")
        empty = next((i for i, t in enumerate(stop) if not t), None)
        if empty is not None:  # worded here: SamplingParams' message quotes the whole list
            name = "stop" if isinstance(req.stop, str) else f"stop[{empty}]"
            raise bad_request(f"{name} is empty; a stop string needs at least one character", "stop")
        try:
            return SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                                  seed=seed, n=req.n, stop=tuple(stop), logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs, output_kind="delta",
                                  skip_special_tokens=req.skip_special_tokens)
        except ValueError as e:
            name = re.match(r"(\w+)", str(e)).group(1)
            param = {"logprobs": logprobs_name}.get(name, name)
            message = str(e).replace(f"{name}=", f"{param}=").replace(f"{name} must", f"{param} must", 1)
            value = getattr(req, param, None)
            raise bad_request(message.replace(f"={value!r}", f"={shown(value)}"), param) from None

    # ----------------------------------------------------------------- running

    async def _run(self, req, prompts: list[list[int]], max_tokens: int, sampling: SamplingParams, *, chat: bool,
                   echo: list[str] | None = None):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        # max_tokens 0 (echo only): one token generated and dropped (see the module docstring).
        requests = [Request(request_id=f"{rid}-{i}", prompt_ids=ids, max_new_tokens=max(max_tokens, 1),
                            sampling=sampling, ignore_eos=req.ignore_eos, cache_salt=req.cache_salt)
                    for i, ids in enumerate(prompts)]
        try:
            stream = await admit(self.loop, requests)
        except ValueError as e:
            message = re.sub(r"^request '[^']*': ", "", str(e))
            param = "n" if "sequences holding" in message else "prompt" if "token id" in message else None
            raise bad_request(message, param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        state = _Response(self, req, rid, requests, sampling, chat=chat, echo=echo, drop_output=max_tokens == 0)
        if req.stream:
            return state.events(stream)
        try:
            async for out in stream:
                state.add(out)
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        finally:
            stream.close()
        return state.final()

    # -------------------------------------------------------------- log-probs

    def token_text(self, token_id: int) -> str:
        """A token's own text, as log-probs name it (vLLM's: the token
        decoded alone; ``token_id:N`` without a tokenizer)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._token_text[token_id] = text
        return text


class _Response:
    """One HTTP request's choices as its outputs arrive, and the OpenAI
    objects made of them. ``echo``: each prompt's text, put before its
    choices (with its log-probs); ``drop_output``: the choices' tokens are
    not the client's (echo with ``max_tokens`` 0)."""

    def __init__(self, serving: OpenAIServing, req, rid: str, requests: list[Request], sampling: SamplingParams, *,
                 chat: bool, echo: list[str] | None = None, drop_output: bool = False):
        self.serving = serving
        self.req = req
        self.id = rid
        self.chat = chat
        self.created = int(time.time())
        self.n = sampling.n
        self.top_k = sampling.logprobs
        self.index_of = {r.request_id: i for i, r in enumerate(requests)}
        self.prompts = [list(r.prompt_ids) for r in requests]
        self.choices = [_Choice(i) for i in range(len(requests) * self.n)]
        self.cached = [0] * len(requests)
        self.host_cached = [0] * len(requests)  # of them, loaded from the host tier
        self.disk_cached = [0] * len(requests)  # and from the disk tier
        self.remote_cached = [0] * len(requests)  # and from another engine (the KV connector)
        self.text_offset = [0] * len(self.choices)
        self._offset_text: dict[int, IncrementalDetokenizer] = {}  # choice -> its completion's text so far
        self.echo = echo
        self.drop_output = drop_output
        self.prompt_logprobs: list[list] = [[] for _ in requests]  # per prompt, as the engine reports them
        self.echoed = [False] * len(self.choices)

    # ------------------------------------------------------------------ intake

    def add(self, out: RequestOutput) -> list[tuple[_Choice, CompletionOutput]]:
        """Takes one delta report; returns the choices it touched with
        their deltas."""
        i = self.index_of[out.request_id]
        self.cached[i] = out.num_cached_tokens
        self.host_cached[i] = out.num_host_cached_tokens
        self.disk_cached[i] = out.num_disk_cached_tokens
        self.remote_cached[i] = out.num_remote_cached_tokens
        self.prompt_logprobs[i] += out.prompt_logprobs or []
        touched = []
        for c in out.outputs:
            if self.drop_output:  # the one token generated is not the client's: only the end is
                c = dataclasses.replace(c, output_ids=[], text="", logprobs=[], stop_reason=None,
                                        finish_reason="length" if c.finish_reason in ("stop", "length")
                                        else c.finish_reason)
            choice = self.choices[i * self.n + c.index]
            choice.ids += c.output_ids
            if c.text:
                choice.text.append(c.text)
            if c.logprobs is not None:
                choice.logprobs += c.logprobs
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, self.stop_reason(c)
            touched.append((choice, c))
        return touched

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached), "cached_tokens_by_tier": {
                    "device": sum(self.cached) - sum(self.host_cached) - sum(self.disk_cached)
                    - sum(self.remote_cached),
                    "host": sum(self.host_cached), "disk": sum(self.disk_cached),
                    "remote": sum(self.remote_cached)}}}

    # ----------------------------------------------------------------- objects

    def final(self) -> dict:
        """The whole response (not streamed)."""
        choices = []
        for ch in self.choices:
            text = "".join(ch.text)
            head, lps = self._echo(ch), None
            if self.top_k is not None:
                lps = _joined(head[1], self._logprobs(ch, ch.ids, ch.logprobs))
            text = head[0] + text
            if self.chat:
                choice = {"index": ch.index, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                          "finish_reason": ch.finish_reason}
            else:
                choice = {"index": ch.index, "text": text, "logprobs": lps, "finish_reason": ch.finish_reason}
            choice["stop_reason"] = ch.stop_reason
            if self.req.return_token_ids:
                choice["token_ids"] = ch.ids
            choices.append(choice)
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.serving.model_name, "choices": choices, "usage": self.usage()}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0] if len(self.prompts) == 1 else self.prompts
        return body

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        """The SSE events of a streamed response; closes ``stream`` however
        it ends (a client that goes away cancels this generator: its
        requests are then aborted)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.serving.model_name}
        try:
            if self.chat:  # the role first, as OpenAI streams it
                yield sse({**head, "choices": [{"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None} for ch in self.choices]})
            try:
                async for out in stream:
                    choices = [self._chunk_choice(ch, c) for ch, c in self.add(out)]
                    if choices:
                        yield sse({**head, "choices": choices})
            except EngineDeadError as e:
                yield sse(APIError(503, str(e), type="server_error", code="engine_dead").body())
                yield SSE_DONE
                return
            options = self.req.stream_options
            if options is not None and options.include_usage:
                yield sse({**head, "choices": [], "usage": self.usage()})
            yield SSE_DONE
        finally:
            stream.close()

    def stop_reason(self, c: CompletionOutput) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string or stop token id that
        ended the choice, None when the model's own EOS token did (or
        none did)."""
        tokenizer = self.serving.tokenizer
        if tokenizer is not None and not isinstance(c.stop_reason, str) and c.stop_reason == tokenizer.eos_id:
            return None
        return c.stop_reason

    def _chunk_choice(self, ch: _Choice, c: CompletionOutput) -> dict:
        finish = c.finish_reason
        head, lps = self._echo(ch), None  # the prompt, in the choice's first chunk
        if self.top_k is not None and c.logprobs is not None:
            lps = _joined(head[1], self._logprobs(ch, c.output_ids, c.logprobs))
        if self.chat:
            delta = {"content": c.text or ""}
            out = {"index": ch.index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            out = {"index": ch.index, "text": head[0] + (c.text or ""), "logprobs": lps, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = self.stop_reason(c)
        if self.req.return_token_ids:
            out["token_ids"] = c.output_ids
        return out

    def _echo(self, ch: _Choice) -> tuple[str, dict | None]:
        """``(text, legacy log-probs)`` of ``ch``'s prompt the first time it
        is asked for with echo on (the text offsets of the choice's tokens
        then count on from the prompt's); ``("", None)`` otherwise. The
        prompt's first token has no log-probability: null, as OpenAI's."""
        if self.echo is None or self.echoed[ch.index]:
            return "", None
        self.echoed[ch.index] = True
        i = ch.index // self.n
        name = self.serving.token_text
        tokens, lps, tops, offsets = [], [], [], []
        entries = self.prompt_logprobs[i] + [None] * (len(self.prompts[i]) - len(self.prompt_logprobs[i]))
        tokenizer = self.serving.tokenizer
        prompt_text = None if tokenizer is None else IncrementalDetokenizer(as_tokenizer(tokenizer), [],
                                                                             skip_special_tokens=False)
        for tok, entry in zip(self.prompts[i], entries):  # (an aborted request's are cut short)
            text = name(tok)
            tokens.append(text)
            lps.append(None if entry is None else _finite(entry[tok]))
            tops.append(None if entry is None else {name(t): _finite(lp) for t, lp in entry.items()})
            offsets.append(self._advance(ch.index, tok, text, prompt_text))
        self.text_offset[ch.index] = len(self.echo[i])  # the completion's text follows the prompt's as sent
        return self.echo[i], {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _advance(self, index: int, tok: int, text: str, decoded: IncrementalDetokenizer | None) -> int:
        """Choice ``index``'s text offset of token ``tok``, then moves it past
        the token: by the characters the token completes in ``decoded`` (the
        text decoded so far; a byte of a character split over tokens adds
        none until the character is whole), or by ``len(text)`` without a
        tokenizer."""
        at = self.text_offset[index]
        if decoded is None:
            self.text_offset[index] = at + len(text)
        else:
            before = len(decoded.text)
            decoded.push(tok)
            self.text_offset[index] = at + len(decoded.text) - before
        return at

    def _logprobs(self, ch: _Choice, ids: list[int], entries: list[dict]) -> dict:
        """OpenAI's log-probs object for ``ids`` (chat: ``{"content":
        [...]}``; completions: the legacy ``tokens`` / ``token_logprobs`` /
        ``top_logprobs`` / ``text_offset`` lists, offsets counted on from the
        choice's earlier chunks)."""
        name = self.serving.token_text
        if self.chat:
            content = []
            for tok, entry in zip(ids, entries):
                text = name(tok)
                content.append({"token": text, "logprob": _finite(entry[tok]), "bytes": list(text.encode()),
                                "top_logprobs": [{"token": name(t), "logprob": _finite(lp),
                                                  "bytes": list(name(t).encode())}
                                                 for t, lp in list(entry.items())[: self.top_k]]})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []
        decoded = None
        if self.serving.tokenizer is not None:
            if ch.index not in self._offset_text:  # the completion as the engine detokenizes it, after the prompt
                self._offset_text[ch.index] = IncrementalDetokenizer(
                    as_tokenizer(self.serving.tokenizer), self.prompts[ch.index // self.n],
                    skip_special_tokens=self.req.skip_special_tokens)
            decoded = self._offset_text[ch.index]
        for tok, entry in zip(ids, entries):
            text = name(tok)
            tokens.append(text)
            lps.append(_finite(entry[tok]))
            tops.append({name(t): _finite(lp) for t, lp in entry.items()})
            offsets.append(self._advance(ch.index, tok, text, decoded))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


def _joined(head: dict | None, tail: dict) -> dict:
    """Legacy log-probs objects, one after the other (``head`` None: ``tail``)."""
    return tail if head is None else {key: head[key] + tail[key] for key in tail}


def _split(prompt) -> tuple[list, list[str]]:
    """The prompts of a completion request's ``prompt`` (one, or a batch)
    and their names in errors."""
    if isinstance(prompt, str) or (prompt and all(is_int(t) for t in prompt)):
        return [prompt], ["prompt"]
    return list(prompt), [f"prompt[{i}]" for i in range(len(prompt))]


def _door(check, name: str, *args):
    """``check(name, *args)`` (a :mod:`paged_jax.checks` helper), its
    ``ValueError`` answered as a 400 naming ``name``."""
    try:
        return check(name, *args)
    except ValueError as e:
        raise bad_request(str(e).replace(f"={args[0]!r}", f"={shown(args[0])}"), name) from None

