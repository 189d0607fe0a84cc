"""Bounds on a request: its body's bytes, refused while the body streams
in, and each field a body can grow, refused by name before any work.

Why bounds at the door: a 50 MB prompt string used to be read whole,
parsed, validated and tokenized (103 s and 6.4 GB of resident memory on
SmolLM2) before its length was compared with a 512-token context. Now:

- the body is counted as it arrives (:class:`BodyLimit`, an ASGI
  middleware): a ``Content-Length`` past :attr:`RequestLimits.max_body_bytes`
  is answered 413 before a byte is read, and a body without one (chunked)
  as soon as the bytes read pass it, so the app holds at most the bound
  (uvicorn's h11 protocol drops the rest of a body the app did not read,
  after the response, so a client that writes its whole body before reading
  still gets the 413 rather than a broken connection);
- a text that cannot fit the context is refused without tokenizing it
  (:meth:`models.tokenizer.Tokenizer.fewest_tokens`, in
  :mod:`server.openai_serving`);
- the lists and strings beside the prompt (a batch's prompts, ``stop``,
  ``logit_bias``, ``messages``, ``cache_salt``) are counted by
  :meth:`RequestLimits.check`;
- an integer of more than :data:`MAX_INT_DIGITS` digits anywhere in the body
  is refused naming where it is (:func:`load_json`):
  Python refuses to convert one to an int (its int-string conversion limit),
  which used to escape the handler as a 500.

Every refusal is an OpenAI error object naming the field (413 for the body,
400 for a field), and leaves the engine untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from starlette.responses import JSONResponse

from models.tokenizer import TokenFloor
from paged_jax.checks import check_instance, check_int
from server.protocol import APIError, bad_request, shown

MIN_BODY_BYTES = 1 << 20
"""The smallest default body bound (1 MiB): room for a context's worth of
text and every other field at its bound on small contexts, and for a
tokenizer without a :class:`models.tokenizer.TokenFloor`."""

JSON_BYTES_PER_TEXT_BYTE = 6
"""The most bytes JSON spends on one byte of text (a control byte is
``\\u001f``, 6; a 4-byte character as a surrogate pair, ``\\ud83d\\ude00``,
is 3 per byte)."""

MESSAGE_JSON_BYTES = 64
"""JSON bytes of one chat message beside its content
(``{"role": "assistant", "content": ""},``: 37, with room for a longer role)."""

FIELDS_JSON_BYTES = 16 << 10
"""JSON bytes of every other field (``model``, the sampling numbers, ...)."""

MAX_PROMPTS = 256
"""The most prompts in one completions batch: each becomes an engine
request of ``n`` sequences, and a body of ``[[1], [1], ...]`` would
otherwise make hundreds of thousands of them."""

MAX_STOP = 32
"""The most stop strings (OpenAI takes 4)."""

MAX_STOP_CHARS = 256
"""The most characters of one stop string: each is searched for in every
choice's new text, token by token."""

MAX_LOGIT_BIAS = 300
"""The most ``logit_bias`` entries (any non-empty ``logit_bias`` is refused
today as unsupported; the bound keeps its parsing small either way)."""

MAX_CACHE_SALT_CHARS = 256
"""The most characters of ``cache_salt``: it is hashed into every cached
page's key and held as long as the request (a tenant id or a random token
takes tens of characters)."""

MAX_INT_DIGITS = 20
"""The most digits of an integer in a body: no field takes a wider one (a
seed is below 2**32, 10 digits; a 64-bit integer has at most 20). A
longer one is refused naming where it is, before any arithmetic: a bound at Python's int-string conversion limit (4,300
digits) let ``len(prompt) + max_tokens`` reach 4,301 digits, which no error
message could then print (a 500)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """The server's bounds on one request; each is a ``python -m server``
    flag (:func:`add_limit_args`).

    Attributes:
      max_body_bytes: the most bytes of a request body (413 past it);
        default :meth:`for_context`'s.
      max_prompts: the most prompts in a completions batch.
      max_messages: the most chat messages; default the context length (a
        chat of more messages than the context has tokens cannot fit when
        the template spends a token on each, as ChatML spends 4 or more).
      max_stop: the most stop strings.
      max_stop_chars: the most characters of one stop string.
      max_logit_bias: the most ``logit_bias`` entries.
      max_cache_salt_chars: the most characters of ``cache_salt``.

    Raises:
      ValueError: a bound that is not an int >= 1.
    """

    max_body_bytes: int
    max_prompts: int = MAX_PROMPTS
    max_messages: int
    max_stop: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_cache_salt_chars: int = MAX_CACHE_SALT_CHARS

    def __post_init__(self):
        for field in dataclasses.fields(self):
            check_int(field.name, getattr(self, field.name), 1)

    @classmethod
    def for_context(cls, max_seq_len: int, *, token_floor: TokenFloor | None, vocab_size: int,
                    **bounds) -> RequestLimits:
        """The defaults for a context of ``max_seq_len`` tokens, with
        ``bounds`` (any attribute) given instead.

        ``max_body_bytes``, unless given, is what the largest single-prompt
        request the server accepts can take: a prompt one token short of
        the context, as text (each token at most ``token_floor.max_token_bytes``
        bytes of text, each text byte at most
        :data:`JSON_BYTES_PER_TEXT_BYTE` bytes of JSON) or as token ids
        (each at most ``vocab_size - 1``'s digits and ``", "``), plus every
        stop string at its bound, ``max_messages`` messages'
        :data:`MESSAGE_JSON_BYTES` and :data:`FIELDS_JSON_BYTES`; at least
        :data:`MIN_BODY_BYTES`. SmolLM2 (81 bytes a token, 49,152 ids):
        1 MiB at 256 or 512 tokens, 1.19 MB at 2,048. A batch of many long
        prompts may not fit it: the 413 says to split the batch or raise the
        flag.

        Raises:
          ValueError: ``max_seq_len`` or ``vocab_size`` not an int >= 1,
            ``token_floor`` not a TokenFloor or None, an unknown bound, or a
            bound not an int >= 1.
        """
        check_int("max_seq_len", max_seq_len, 1)
        check_int("vocab_size", vocab_size, 1)
        if token_floor is not None:
            check_instance("token_floor", token_floor, TokenFloor, what="models.tokenizer.TokenFloor")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(bounds) - known)
        if unknown:
            raise ValueError(f"unknown bounds {unknown}; known: {sorted(known)}")
        bounds.setdefault("max_messages", max_seq_len)
        probe = cls(**{"max_body_bytes": 1, **bounds})  # every bound checked, the defaults filled in
        if "max_body_bytes" not in bounds:
            text = 0 if token_floor is None else token_floor.max_token_bytes * JSON_BYTES_PER_TEXT_BYTE
            per_token = max(text, len(str(vocab_size - 1)) + 2)
            stops = probe.max_stop * (probe.max_stop_chars * JSON_BYTES_PER_TEXT_BYTE + 4)
            need = ((max_seq_len - 1) * per_token + stops + probe.max_messages * MESSAGE_JSON_BYTES
                    + FIELDS_JSON_BYTES)
            bounds["max_body_bytes"] = max(MIN_BODY_BYTES, need)
        return cls(**bounds)

    def check(self, req) -> None:
        """Refuses, by name, a field of ``req`` (a
        :class:`server.protocol.CompletionRequest` or
        :class:`server.protocol.ChatCompletionRequest`) past its bound.

        Raises:
          APIError: a 400 naming the field, its size and the bound.
        """
        prompt = getattr(req, "prompt", None)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            _at_most("prompt", prompt, self.max_prompts, "prompts in a batch", "max-prompts")
        messages = getattr(req, "messages", None)
        if messages is not None:
            _at_most("messages", messages, self.max_messages, "messages", "max-messages")
        if isinstance(req.stop, list):
            _at_most("stop", req.stop, self.max_stop, "stop strings", "max-stop")
        stops = [("stop", req.stop)] if isinstance(req.stop, str) else [
            (f"stop[{i}]", s) for i, s in enumerate(req.stop or ())]
        for name, s in stops:
            if len(s) > self.max_stop_chars:
                raise bad_request(f"{name} is {len(s)} characters; a stop string may have at most "
                                  f"{self.max_stop_chars} (--max-stop-chars), got {name}={shown(s)}", "stop")
        if req.logit_bias is not None:
            _at_most("logit_bias", req.logit_bias, self.max_logit_bias, "entries", "max-logit-bias")
        if req.cache_salt is not None and len(req.cache_salt) > self.max_cache_salt_chars:
            raise bad_request(f"cache_salt is {len(req.cache_salt)} characters; it may have at most "
                              f"{self.max_cache_salt_chars} (--max-cache-salt-chars), got "
                              f"cache_salt={shown(req.cache_salt)}", "cache_salt")


def _at_most(name: str, items, most: int, what: str, flag: str) -> None:
    if len(items) > most:
        raise bad_request(f"{name} has {len(items)} {what}; at most {most} are accepted (--{flag}), got "
                          f"{name}={shown(items)}", name)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Adds a flag per :class:`RequestLimits` bound (``--max-body-bytes``,
    ``--max-prompts``, ...), each defaulting to None: the bound's default."""
    helps = {
        "max_body_bytes": "most bytes of a request body, refused (413) while it streams in (default: what a "
                          "context's worth of prompt and every field at its bound can take, at least 1 MiB)",
        "max_prompts": f"most prompts in one completions batch (default {MAX_PROMPTS})",
        "max_messages": "most chat messages (default: the context length in tokens)",
        "max_stop": f"most stop strings (default {MAX_STOP})",
        "max_stop_chars": f"most characters of one stop string (default {MAX_STOP_CHARS})",
        "max_logit_bias": f"most logit_bias entries (default {MAX_LOGIT_BIAS})",
        "max_cache_salt_chars": f"most characters of cache_salt (default {MAX_CACHE_SALT_CHARS})",
    }
    for field in dataclasses.fields(RequestLimits):
        p.add_argument("--" + field.name.replace("_", "-"), type=int, default=None, metavar="N",
                       help=helps[field.name])


def limit_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """The bounds given on the command line, ``{attribute: value}``, for
    :meth:`RequestLimits.for_context`; exits with an argparse error naming
    a flag below 1."""
    given = {}
    for field in dataclasses.fields(RequestLimits):
        value = getattr(args, field.name)
        if value is not None:
            if value < 1:
                p.error(f"--{field.name.replace('_', '-')} must be >= 1, got {value}")
            given[field.name] = value
    return given


class BodyLimit:
    """ASGI middleware: a request body of more than ``max_body_bytes`` is
    answered 413 (an OpenAI error object) after at most that many bytes
    were read: at once when its ``Content-Length`` says so, else (chunked,
    or a ``Content-Length`` that lies) when the count passes the bound,
    from the handler's read (:class:`APIError`, which the app's handler
    answers).

    Args:
      app: the ASGI app.
      max_body_bytes: the bound (an int >= 1).
    """

    def __init__(self, app, *, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = check_int("max_body_bytes", max_body_bytes, 1)

    def _too_large(self, what: str) -> APIError:
        return APIError(413, f"the request body {what}, past this server's bound of {self.max_body_bytes} bytes "
                             "(--max-body-bytes): send fewer or shorter prompts per request",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        """Serves one ASGI connection scope (HTTP requests counted, others
        passed through). A 413 closes the connection (``Connection:
        close``): the server then stops reading the body, where keeping the
        connection alive would read and drop whatever the client goes on
        sending (an endless chunked body: for ever)."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            error = self._too_large(f"is {int(declared)} bytes (its Content-Length)")
            return await JSONResponse(error.body(), error.status, headers={"Connection": "close"})(scope, receive, send)
        seen = 0
        over = False

        async def counted():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    over = True
                    raise self._too_large(f"has more than {self.max_body_bytes} bytes")
            return message

        async def closing(message):
            if over and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted, closing)


class _HugeInt:
    """An integer of more than :data:`MAX_INT_DIGITS` digits, as parsed (its
    digits are kept only for the message)."""

    __slots__ = ("digits",)

    def __init__(self, digits: str):
        self.digits = digits


def load_json(raw: bytes):
    """``json.loads(raw)``, refusing an integer of more than
    :data:`MAX_INT_DIGITS` digits anywhere in it, in a known field or one
    the server ignores (the body is walked only when it holds one).

    Raises:
      APIError: a 400 naming where the integer is (``max_tokens``,
        ``prompt[3]``, ``metadata.x``; ``param`` the top-level field) and
        how many digits it has.
      json.JSONDecodeError, UnicodeDecodeError, RecursionError: as
        ``json.loads``.
    """
    huge = []

    def parse_int(digits: str):
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            huge.append(digits)
            return _HugeInt(digits)
        return int(digits)

    data = json.loads(raw, parse_int=parse_int)
    if huge:
        _refuse_huge_int(data)
    return data


def _refuse_huge_int(data) -> None:
    stack = [("", None, data)]  # iterative: a body may nest as deep as JSON's parser allows
    while stack:
        path, top, value = stack.pop()
        if isinstance(value, _HugeInt):
            digits = len(value.digits.lstrip("-"))
            where = path or "the request body"
            raise bad_request(f"{where}: an integer of {digits} digits is too large; integers may have at most "
                              f"{MAX_INT_DIGITS} digits, got {value.digits[:20]}... ({digits} digits)", top)
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else k, top or k, v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", top, v) for i, v in enumerate(value)]
