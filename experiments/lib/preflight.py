"""Checks a serving benchmark makes before it loads a model or warms up.

Why a module of its own: a benchmark's first minutes go to loading weights,
allocating the KV pool and compiling every program in a warm-up; a flag
that cannot work (a pool no machine could hold, ``n`` samples beyond the
running-sequence limit, a server that is not there or does not serve the
model asked for) should fail in the first second, with an argparse error
naming the flag, not after those minutes with a traceback. Each check here
reads only what it needs: a model's config (``config.json``, a GGUF's
metadata, a preset) rather than its weights; a server's ``/health`` and
``/v1/models`` with a short timeout rather than a warm-up request.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from collections.abc import Callable, Sequence

import httpx
import jax
import jax.numpy as jnp

from experiments.lib.cli import available_memory_bytes
from experiments.lib.online import TOY_CONFIG
from experiments.lib.serving import pool_pages
from experiments.lib.workloads import Workload
from models.config import LlamaConfig
from models.deepseek.config import MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from models.deepseek.config import DeepseekConfig
from models.deepseek.gguf import is_deepseek_gguf, read_gguf_deepseek_config
from models.deepseek.loader import read_deepseek_config
from models.deepseek.presets import num_params as deepseek_num_params
from models.llm import SMOLLM2
from models.loading.gguf_loader import open_gguf, read_config
from models.loading.hf_config import CONFIG
from models.loading.hf_loader import read_hf_config, read_json
from models.presets import PRESETS
from paged_jax.engine.core import Engine
from paged_jax.engine.requests import Request

PROBE_TIMEOUT_S = 5.0
"""Seconds a server gets to answer ``/health`` and ``/v1/models`` before
the benchmark gives up on it."""


def model_config(spec: str) -> LlamaConfig | DeepseekConfig:
    """The decoder config of a ``--model`` spec without its weights:
    ``toy``, a random-weight preset, ``smollm2`` or a ``.gguf`` (its
    metadata), a Hugging Face folder (its ``config.json``; a DeepSeek-V3 /
    V2 / Kimi K2 one, folder or ``deepseek2`` GGUF, gives a
    :class:`models.deepseek.config.DeepseekConfig`, which counts its latent
    pool's bytes the same way).

    Raises:
      FileNotFoundError, ValueError: from the readers; a spec that is none
        of these.
    """
    if spec == "toy":
        return TOY_CONFIG
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == SMOLLM2:
        return LlamaConfig(**read_config(open_gguf()))
    path = pathlib.Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        if is_deepseek_gguf(path):
            return read_gguf_deepseek_config(path)
        return LlamaConfig(**read_config(open_gguf(path)))
    if path.is_dir():
        if (path / CONFIG).is_file() and read_json(path / CONFIG).get("model_type") in DEEPSEEK_MODEL_TYPES:
            return read_deepseek_config(path)
        return read_hf_config(path)
    raise ValueError(f"--model {spec!r}: expected 'smollm2', 'toy', a preset {sorted(PRESETS)}, a .gguf file or a "
                     "Hugging Face folder")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def check_kv_budget(p: argparse.ArgumentParser, flag: str, kv_tokens: int, page_size: int,
                    config: LlamaConfig | DeepseekConfig, *, kv_dtype, weight_dtype,
                    available: int | None = None) -> int:
    """The KV pool's bytes, or an argparse error naming ``flag`` when the
    pool and the weights together need more than the device has available
    (:func:`experiments.lib.cli.available_memory_bytes`, or ``available``):
    such a pool could never be allocated, and trying would take the machine
    down or fail after the model has loaded.

    Args:
      kv_tokens: the pool's tokens (whole pages of ``page_size``, plus the
        null page, as :func:`experiments.lib.serving.pool_pages` counts them).
      kv_dtype, weight_dtype: the pool's and the weights' dtypes.
    """
    kv_dtype = jnp.dtype(kv_dtype)
    per_token = config.kv_bytes_per_token(kv_dtype)
    pool = pool_pages(kv_tokens, page_size) * page_size * per_token
    params = deepseek_num_params(config) if isinstance(config, DeepseekConfig) else config.num_params
    weights = params * jnp.dtype(weight_dtype).itemsize
    have = available_memory_bytes() if available is None else available
    if have is not None and pool + weights > have:
        p.error(f"{flag} {kv_tokens:,}: the KV pool would take {_gb(pool)} ({per_token:,} bytes per token in "
                f"{kv_dtype.name}) beside {_gb(weights)} of weights, more than the {_gb(have)} "
                f"{jax.default_backend()} has available; at most about {(have - weights) // per_token:,} tokens fit")
    return pool


def check_workload_fits(p: argparse.ArgumentParser, workload: Workload, max_seqs: int) -> None:
    """An argparse error naming ``--workload`` when one of its requests runs
    more sequences at once (``parallel-N``: N samples, ``beam-W``: W beams)
    than ``--max-seqs``: the engine would refuse every request."""
    k = workload.sampling(0).num_seqs
    if k > max_seqs:
        p.error(f"--workload {workload.name}: each request runs {k:,} sequences at once, more than --max-seqs "
                f"{max_seqs}; the engine would refuse every request")


def check_requests(build: Callable[[str], Engine], policies: Sequence[str], requests: Sequence[Request]) -> None:
    """Raises ``ValueError`` naming the first request an engine of some
    policy refuses (:meth:`paged_jax.engine.core.Engine.check_request`: its
    length, its sequences against the pool), before a warm-up is spent on
    a run that cannot start."""
    for policy in policies:
        engine = build(policy)
        taken: set = set()
        for r in requests:
            try:
                engine.check_request(r, taken)
            except ValueError as e:
                raise ValueError(f"--policy {policy}: {e}") from None
            taken.add(r.request_id)


def check_lengths(requests: Sequence[Request], max_model_len: int) -> None:
    """Raises ``ValueError`` when a request needs more tokens (prompt plus
    output) than a server's ``max_model_len`` (0: the server did not say;
    nothing is checked): the server would refuse it mid-run, after the
    warm-up."""
    need = [len(r.token_ids()) + r.max_new_tokens for r in requests]
    over = [i for i, n in enumerate(need) if n > max_model_len]
    if max_model_len and over:
        first = requests[over[0]]
        raise ValueError(f"{len(over)} of {len(requests)} requests need more tokens than the server's max_model_len "
                         f"{max_model_len} (the first, {first.request_id!r}: {len(first.token_ids())} in the prompt "
                         f"+ {first.max_new_tokens} output); start the server with --max-seq-len {max(need)} or "
                         "more, or lower --max-output-len")


# ------------------------------------------------------------------- a server


def server_root(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: the server's root.

    Why accept ``/v1`` rather than refuse it: OpenAI clients take their
    ``base_url`` with ``/v1`` (``http://127.0.0.1:8000/v1``), so that is the
    URL people copy; this client also needs ``/health``, ``/metrics`` and
    ``/reset_prefix_cache``, which live at the root.

    Raises:
      ValueError: not an ``http://`` or ``https://`` URL with a host, or one
        with a query or another path.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise ValueError(f"--base-url {url!r} is not a URL: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--base-url {url!r}: expected http://HOST:PORT (the server's root, or with /v1)")
    path = parsed.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    if path or parsed.query or parsed.fragment:
        raise ValueError(f"--base-url {url!r}: expected the server's root (http://HOST:PORT) or its /v1, not "
                         f"another path")
    return str(parsed.copy_with(path="/", query=None, fragment=None)).rstrip("/")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What a server said it serves (``GET /v1/models``).

    Attributes:
      name: the model to send (``--served-model``, else the first listed).
      max_model_len: its most tokens per sequence (0 if not said).
      names: every model the server lists.
    """

    name: str
    max_model_len: int
    names: tuple[str, ...]


def probe_server(base_url: str, *, api_key: str | None, model: str | None,
                 timeout_s: float = PROBE_TIMEOUT_S) -> ServedModel:
    """Checks that a server answers at ``base_url`` (its root), is healthy,
    takes ``api_key`` and serves ``model`` (None: any, the first).

    Raises:
      ValueError: with the flag to fix first in the message (``--base-url``:
        nothing answers, or ``/health`` is not ok; ``--api-key``: a 401;
        ``--served-model``: not listed).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        try:
            health = client.get("/health")
        except httpx.HTTPError as e:
            raise ValueError(f"--base-url {base_url}: no server answers there ({type(e).__name__}: {e}); start one "
                             "(python -m server) or fix the URL") from None
        if health.status_code != 200:
            raise ValueError(f"--base-url {base_url}: GET /health answered {health.status_code}: "
                             f"{health.text[:300]}")
        try:
            listed = client.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"--base-url {base_url}: GET /v1/models failed ({type(e).__name__}: {e})") from None
    if listed.status_code == 401:
        raise ValueError(f"--api-key: the server at {base_url} refused it (401: {listed.text[:200]}); pass its key "
                         "(--api-key or $PAGED_JAX_API_KEY)")
    try:
        cards = listed.json()["data"] if listed.status_code == 200 else None
        names = tuple(str(c["id"]) for c in cards)
    except (ValueError, KeyError, TypeError):
        cards = None
    if not cards:
        raise ValueError(f"--base-url {base_url}: GET /v1/models answered {listed.status_code} without a model: "
                         f"{listed.text[:300]}")
    if model is not None and model not in names:
        raise ValueError(f"--served-model {model!r}: the server at {base_url} serves {list(names)}")
    card = cards[names.index(model)] if model is not None else cards[0]
    return ServedModel(name=str(card["id"]), max_model_len=int(card.get("max_model_len") or 0), names=names)
