"""The OpenAI API's request bodies and error objects, as pydantic models.

Why strict models that ignore unknown keys: OpenAI's clients send fields
this server has no use for (``user``, ``metadata``, ``service_tier``) and
tools such as vLLM's benchmark send vLLM's extensions, so an unknown key is
ignored, as OpenAI does; but a known field of the wrong type
(``"max_tokens": "ten"``, ``"stream": 1``) is refused with a 400 naming the
field, rather than coerced (pydantic's lax mode would turn ``"10"`` into
10 and ``1`` into True). Strict mode still takes an int where a float is
expected (``"temperature": 0``).

Fields whose values would change the output in ways the engine cannot
compute (penalties, ``logit_bias``, ``echo`` without ``logprobs`` or in
chat, ``best_of`` other than ``n``, tools) are known here so that a
non-default value is refused by name instead of silently ignored
(:func:`unsupported`).

Error messages quote a client's values through :func:`shown` (at most
:data:`SHOWN_CHARS` characters, then how long the whole was), and no
message is longer than :data:`MAX_MESSAGE_CHARS`.

vLLM's extensions: ``ignore_eos``, ``cache_salt``, ``skip_special_tokens``
and ``return_token_ids`` (each choice then carries its ``token_ids``, and the
response its ``prompt_token_ids``: what a benchmark needs to count tokens
per streamed chunk exactly).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(strict=True, extra="ignore")

SHOWN_CHARS = 200
"""The most characters of a client's value that an error message echoes
(:func:`shown`): a 1 MB ``model`` or a list of 5,000 stop strings must not
come back whole in every error (nor fill the server's logs)."""

MAX_MESSAGE_CHARS = 1000
"""The longest error message sent: a backstop for messages worded below the
server (the engine's, a chat template's) that may quote a client's value."""


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` if at most ``limit`` characters, else its first ``limit``
    and ``"... (N chars)"``."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _as_sent(value):
    """``value`` with pydantic models replaced by the fields the client set: the model itself, or the
    items of a list of them as far as :data:`SHOWN_CHARS` items reach (the rest is never shown)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    if isinstance(value, (list, tuple)) and any(isinstance(v, BaseModel) for v in value[:1]):
        head = [_as_sent(v) for v in value[:SHOWN_CHARS]]
        return head + list(value[SHOWN_CHARS:])
    return value


def shown(value) -> str:
    """``repr(value)`` for an error message, at most :data:`SHOWN_CHARS`
    characters and then how long the whole was: ``"... (N chars)"`` for a
    str (or a number's digits), ``"... (N items)"`` for a list, tuple or
    dict. A request object inside is shown as the fields the client sent
    (``{'role': 'user', 'content': 'a'}``), not as this server's class."""
    value = _as_sent(value)
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value)} items" if isinstance(value, (list, tuple, dict)) else (
        f"{len(value)} chars" if isinstance(value, str) else f"{len(text)} chars")
    return f"{text[:SHOWN_CHARS]}... ({size})"


class APIError(Exception):
    """An error the server answers with an OpenAI error object.

    Attributes:
      status: the HTTP status (400 bad request, 401 bad key, 404 unknown
        model or route, 500 server error, 503 engine down).
      message: what is wrong, for a person.
      type: OpenAI's error type (``invalid_request_error``, ...).
      param: the request field at fault, or None.
      code: OpenAI's error code (``model_not_found``, ...), or None.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields the two endpoints share (OpenAI's defaults; vLLM's extensions
    at the end)."""

    model_config = _STRICT
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's extensions
    ignore_eos: bool = False
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """``(field, why)`` for each field whose value the engine cannot
        honour (refused with a 400 rather than ignored)."""
        out = []
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                out.append((name, "penalties are not supported"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", f"best_of other than n is not supported, got best_of={shown(self.best_of)} "
                                   f"n={shown(self.n)}"))
        return out


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a str, token ids, or a batch
    of either (each prompt gets ``n`` choices, indexed prompt by prompt).
    ``echo`` with ``logprobs`` puts the prompt before each choice's text and
    its tokens' log-probabilities before the completion's (the first
    token's null); with ``max_tokens: 0`` the prompt alone (how evaluation
    harnesses score a text)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo and self.logprobs is None:
            out.append(("echo", "echo is supported with logprobs only (to score a prompt: its text and its tokens' "
                                "log-probabilities); set logprobs"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; ``content`` a str or a list of text parts (joined with
    newlines, as vLLM joins them)."""

    model_config = _STRICT
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the
    checkpoint's chat template; ``max_completion_tokens`` (OpenAI's newer
    name) wins over ``max_tokens``; ``logprobs`` a bool and
    ``top_logprobs`` the number of alternatives per token."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    echo: bool = False  # vLLM's extension: the reply prefixed with the last message of its role

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported for chat completions"))
        if self.tools:
            out.append(("tools", "tool calling is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only response_format {'type': 'text'} is supported"))
        return out


def validation_error(e: pydantic.ValidationError) -> APIError:
    """A 400 naming the first field pydantic refused (``param``, its dotted
    path). A union's refusal lists what each branch expected: pydantic
    names the branches it tried in the path (``prompt.str``,
    ``prompt.list[int].0``); the client's field is the part before them."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = list(first.get("loc", ()))
    cut = next((i for i, p in enumerate(loc) if _is_union_label(p)), len(loc))
    field = loc[:cut]
    param = ".".join(str(p) for p in field) or None
    got = shown(first.get("input"))
    branches = [err["loc"][cut] for err in errors
                if len(err.get("loc", ())) > cut and list(err["loc"][:cut]) == field and _is_union_label(err["loc"][cut])]
    branches = list(dict.fromkeys(branches))
    if len(branches) > 1:
        what = "expected " + ", ".join(branches[:-1]) + " or " + branches[-1]
    else:
        what = first.get("msg", "invalid value")
    return bad_request(f"{param}: {what}, got {got}" if param else what, param)


def _is_union_label(part) -> bool:
    """Whether a location part names a union branch (``str``,
    ``list[int]``, ``list[TextPart]``) rather than a field or an index."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)
