"""The documentation builds with no warning, and no code block in it or in the README rots.

- The Sphinx build (``make docs``) runs with warnings as errors: an unresolved link between pages, a
  broken docstring, a page outside the table of contents each fail it.
- Every ``python`` block runs, the blocks of one page in order in one namespace (a page's later block
  uses what its earlier ones made), in a fresh process, in a scratch folder.
- A page that talks to the server at ``http://127.0.0.1:8000`` (its ``curl`` lines, its ``openai``
  blocks) runs against a real one on SmolLM2, started here on a free port, which the address is
  rewritten to.
- Every other shell command is checked without running its hours of work: a ``make`` target must
  exist (``make -n``); a ``python -m`` module must import and its parser accept the very flags shown.
- Relative links in the Markdown point at files that exist.
- Blocks are ``python``, ``bash`` or ``text`` (output, diagrams): an unknown fence language fails, so a
  new block cannot slip past these checks.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

DOCS_URL = "http://127.0.0.1:8000"
"""Where the pages' examples find the server (``make serve``)."""

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "text"}


def blocks(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(language, first line number, code)`` of each fenced block; MyST directives (```{toctree}) are not code."""
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number + 1, []
            else:
                out.append((lang, start, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path.name}: a block opened at line {start - 1} is never closed"
    return [b for b in out if not b[0].startswith("{")]


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def test_pages_are_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "index.md", "api.md", "engine.md", "paging.md"} <= names
    assert sum(lang == "python" for p in PAGES for lang, _, _ in blocks(p)) >= 8


@pytest.mark.parametrize("path", PAGES, ids=_ids(PAGES))
def test_block_languages(path):
    bad = [(line, lang) for lang, line, _ in blocks(path) if lang not in LANGUAGES]
    assert not bad, f"{path.name}: blocks at lines {bad} are not one of {sorted(LANGUAGES)}"


PYTHON_PAGES = [p for p in PAGES if any(lang == "python" for lang, _, _ in blocks(p))]


@pytest.fixture(scope="module")
def docs_server():
    """``make serve``'s server (SmolLM2, no API key), small, on a free port: its URL."""
    import jax.numpy as jnp

    from models.llm import LLM
    from server import ThreadedServer, build_app

    llm = LLM("smollm2", dtype=jnp.float32, kv_tokens=1024, page_size=16, max_seqs=4, max_seq_len=512,
              max_num_batched_tokens=64)
    with ThreadedServer(build_app(llm, model_name="smollm2")) as srv:
        yield srv.url


def with_server(text: str, request) -> str:
    return text.replace(DOCS_URL, request.getfixturevalue("docs_server")) if DOCS_URL in text else text


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=_ids(PYTHON_PAGES))
def test_python_blocks_run(path, tmp_path, request):
    parts = [f"# --- {path.name}, line {line}\n{with_server(code, request)}"
             for lang, line, code in blocks(path) if lang == "python"]
    script = tmp_path / "page.py"
    # Each block in order, in one namespace; a failure names its block's first line in the traceback.
    script.write_text("\n\n".join(parts) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{path.name}'s python blocks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def shell_commands(code: str) -> list[list[str]]:
    """A block's commands as argument lists: continuations joined, comments and ``VAR=value`` prefixes dropped."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def check_make(words, request):
    proc = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"`{' '.join(words)}`: {proc.stderr.strip()}"


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory):
    """What a page's ``~/ckpt/...`` stands for: a Hugging Face folder of the reader's (a tiny random Llama 3)."""
    from family_helpers import write_checkpoint

    folder = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(folder, "llama3")
    return str(folder)


def check_python_module(words, request):
    assert words[1] == "-m", f"`{' '.join(words)}`: the docs run scripts as `python -m module`"
    module, argv = words[2], words[3:]
    # A path of the reader's own (~/ckpt/...) is checked against a real folder of that kind.
    argv = [request.getfixturevalue("user_checkpoint") if a.startswith("~/ckpt/") else a for a in argv]
    mod = importlib.import_module(module if module != "server" else "server.__main__")
    parse = getattr(mod, "parse_args", None)
    assert parse is not None, f"{module} has no parse_args(argv) to check `{' '.join(argv)}` against"
    # A command for a bigger machine (Llama-3-8B on a GPU) is checked for its flags, not against this one's
    # free memory, which the tests running beside it take.
    monkeypatch = request.getfixturevalue("monkeypatch")
    if hasattr(mod, "available_memory_bytes"):
        monkeypatch.setattr(mod, "available_memory_bytes", lambda: 1 << 40)
    try:
        parse(argv)
    except SystemExit as e:  # argparse's refusal
        pytest.fail(f"`{' '.join(words)}`: the flags are refused ({e})")


def check_curl(words, request):
    """Runs it against the live server: an HTTP error fails it (``--fail-with-body``), and so does an
    error object inside a 200 stream."""
    argv = [with_server(w, request) for w in words] + ["--fail-with-body", "--max-time", "300"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, f"`{' '.join(words)}` failed ({proc.returncode}): {proc.stdout[-2000:]}"
    body = proc.stdout.strip()
    if body.startswith("data:"):  # a stream: every event parses, none is an error, it ends with [DONE]
        events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
        assert events[-1] == "[DONE]", body[-500:]
        assert all("error" not in json.loads(e) for e in events[:-1]), body[-2000:]
    else:
        assert json.loads(body)["choices"], body[-2000:]


CHECKS = {"make": check_make, "python": check_python_module, "curl": check_curl}
SHELL = [(p, line, code) for p in PAGES for lang, line, code in blocks(p) if lang == "bash"]


@pytest.mark.parametrize("path,line,code", SHELL, ids=[f"{p.name}:{line}" for p, line, _ in SHELL])
def test_shell_blocks(path, line, code, request):
    commands = shell_commands(code)
    assert commands, f"{path.name}:{line}: an empty shell block"
    for words in commands:
        assert words[0] in CHECKS, f"{path.name}:{line}: no check for `{words[0]}`; add one to CHECKS"
        CHECKS[words[0]](words, request)


@pytest.mark.parametrize("path", PAGES, ids=_ids(PAGES))
def test_relative_links_exist(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'href="([^"]+)"', text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#")[0]
        # Relative to the page, as a Markdown reader resolves it (docs/conf.py rewrites ../results/ for the site).
        diagram = path.parent.name == "docs" and file.startswith("diagram/")
        if not (path.parent / file).exists() and not (diagram and (ROOT / "docs" / file).exists()):
            missing.append(target)
    assert not missing, f"{path.name} links to missing files: {missing}"


def test_docs_build_without_warnings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(ROOT / "docs"), str(tmp_path / "html")], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"make docs fails:\n{proc.stderr[-6000:]}"
    assert (tmp_path / "html" / "api.html").exists() and (tmp_path / "html" / "diagram" / "index.html").exists()
