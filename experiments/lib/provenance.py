"""How a results file was made: one provenance block in every table the experiments write.

A table that cannot say how it was made cannot be reproduced. Every ``.md``
and ``.csv`` file under ``results/`` therefore carries the same block:

* ``command``: the command line as run (``python -m experiments.memory.sharing --parts a``);
* ``commit`` and ``dirty``: ``git rev-parse HEAD`` of this checkout and
  whether ``git status --porcelain`` listed anything (with the number of
  paths and a hash of ``git diff HEAD`` and of the untracked files' names
  and contents, so two dirty runs can be told apart); ``unknown`` when git or the repository is absent;
* ``python``, ``jax``, ``jaxlib``, ``flax``, ``numpy``: versions;
* ``backend``, ``device_kind``, ``device_count``: ``jax.default_backend()``,
  ``jax.devices()[0].device_kind`` and ``len(jax.devices())``;
* ``seeds``: every seed the script used, as ``name=value`` pairs;
* ``date``: UTC, to the second.

Markdown files end with the block (after a ``<!-- provenance -->`` marker,
as ``- key: value`` lines); CSV files begin with it as ``# key: value``
comment lines, so the rows stay loadable: ``read_csv`` here, or
``pandas.read_csv(path, comment="#")`` where no cell holds a ``#``. :func:`render` is the one function
that writes the block; :func:`write_markdown` and :func:`write_csv` write a
file with it, and :func:`experiments.lib.tables.write_table`, which the scripts
call, writes a table's two.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import importlib.metadata
import pathlib
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence

from paged_jax.checks import is_int

REPO = pathlib.Path(__file__).resolve().parents[2]
MARKER = "<!-- provenance -->"
"""The line that opens the block in a Markdown file; everything after it is the block."""
VERSIONED = ("jax", "jaxlib", "flax", "numpy")
"""Distributions whose versions the block records (Python's is recorded too)."""
FIELDS = ("command", "commit", "dirty", "python", *VERSIONED, "backend", "device_kind", "device_count", "seeds",
          "date")
"""The block's keys, in the order written."""
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Provenance:
    """One run's record. Every field is a string as written in the block
    (``device_count`` is a decimal integer, ``seeds`` ``"a=0, b=1"`` or
    ``"none"``, ``date`` ISO 8601 UTC ending in ``Z``)."""

    command: str
    commit: str
    dirty: str
    python: str
    jax: str
    jaxlib: str
    flax: str
    numpy: str
    backend: str
    device_kind: str
    device_count: str
    seeds: str
    date: str

    def as_dict(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in FIELDS}


def collect(
    module: str,
    argv: Sequence[str] | None = None,
    *,
    seeds: Mapping[str, int] | None = None,
    repo: pathlib.Path | str = REPO,
) -> Provenance:
    """Gathers the record of the run in progress.

    Args:
      module: the script's module, ``"experiments.memory.reproduce"``; the command
        is written ``python -m <module> <argv>``.
      argv: the arguments the script parsed; ``None`` (as ``main(None)``
        passes on) means ``sys.argv[1:]``.
      seeds: every seed the run used, by name (``{"sharegpt_shuffle": 0}``).
      repo: the checkout whose commit is recorded (default: the one this
        file is in). Outside a git checkout, or without git, ``commit`` and
        ``dirty`` say ``unknown`` and why; nothing is raised.

    Raises:
      ValueError: a seed that is not an int, or a name with ``=``, ``,`` or
        white space (the block could not be read back).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    seeds = dict(seeds or {})
    for name, value in seeds.items():
        if not is_int(value):
            raise ValueError(f"seeds must map names to ints, got {name}={value!r}")
        if not name or any(c in name for c in "=, \t\n"):
            raise ValueError(f"seed names must be non-empty without '=', ',' or white space, got {name!r}")
    commit, dirty = _git_state(pathlib.Path(repo))
    backend, kind, count = _devices()
    return Provenance(
        command=shlex.join(["python", "-m", module, *args]),
        commit=commit,
        dirty=dirty,
        python=platform.python_version(),
        jax=_version("jax"),
        jaxlib=_version("jaxlib"),
        flax=_version("flax"),
        numpy=_version("numpy"),
        backend=backend,
        device_kind=kind,
        device_count=count,
        seeds=", ".join(f"{k}={v}" for k, v in seeds.items()) or "none",
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def render(record: Provenance, style: str) -> str:
    """The block as text, ending in a newline.

    Args:
      style: ``"markdown"`` (a marker line, a heading, ``- key: value``
        lines) or ``"csv"`` (``# key: value`` lines, to precede the header).

    Raises:
      ValueError: an unknown style.
    """
    # One line a value: a newline in a command-line argument would end it early.
    items = [(k, v.replace("\\", "\\\\").replace("\n", "\\n")) for k, v in record.as_dict().items()]
    if style == "markdown":
        return "\n".join([MARKER, "## Provenance", ""] + [f"- {k}: {v}" for k, v in items]) + "\n"
    if style == "csv":
        return "".join(f"# {k}: {v}\n" for k, v in items)
    raise ValueError(f"style must be 'markdown' or 'csv', got {style=}")


def write_markdown(path: pathlib.Path | str, text: str, record: Provenance) -> None:
    """Writes ``text`` to ``path`` followed by the provenance block.

    Raises:
      ValueError: ``text`` already holds a provenance marker.
    """
    if MARKER in text:
        raise ValueError(f"{path}: the text already holds a provenance block")
    pathlib.Path(path).write_text(text.rstrip("\n") + "\n\n" + render(record, "markdown"))


def write_csv(
    path: pathlib.Path | str, rows: Iterable[Mapping], fieldnames: Sequence[str], record: Provenance
) -> None:
    """Writes the provenance block as ``# key: value`` lines, then ``rows``
    as CSV under a ``fieldnames`` header (missing keys empty)."""
    with open(path, "w", newline="") as f:
        f.write(render(record, "csv"))
        w = csv.DictWriter(f, fieldnames=list(fieldnames))
        w.writeheader()
        w.writerows(rows)


def publish(out: pathlib.Path | str, stem: str, module: str, argv, seeds: Mapping, text: str,
            rows: Sequence[Mapping]) -> None:
    """Prints ``text`` and writes ``out/stem.md`` (``text``) and
    ``out/stem.csv`` (``rows``, the first row's keys as the header), each
    with the provenance of ``python -m module argv`` and ``seeds``; makes
    ``out`` if missing."""
    print(text)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = collect(module, argv, seeds=seeds)
    write_markdown(out / f"{stem}.md", text, record)
    write_csv(out / f"{stem}.csv", rows, list(rows[0]), record)


def read_csv(path: pathlib.Path | str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Reads a CSV written by :func:`write_csv` (or one without a block).

    Returns:
      ``(provenance, rows)``: the block's ``key -> value`` (empty if none)
      and the rows as dicts of strings keyed by the header.
    """
    with open(path, newline="") as f:
        lines = f.read().splitlines(keepends=True)
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    return _parse_lines(lines[:head], "# "), list(csv.DictReader(lines[head:]))


def split_markdown(text: str) -> tuple[str, dict[str, str]]:
    """Splits a Markdown file's text into ``(body, provenance)``; a text
    without a block gives ``(text, {})``."""
    body, marker, block = text.partition(MARKER)
    if not marker:
        return text, {}
    return body.rstrip("\n") + "\n", _parse_lines(block.splitlines(), "- ")


def _parse_lines(lines: Iterable[str], prefix: str) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.rstrip("\r\n")
        key, sep, value = line[len(prefix):].partition(": ")
        if line.startswith(prefix) and sep and key in FIELDS:
            out[key] = re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)
    return out


def _git_state(repo: pathlib.Path) -> tuple[str, str]:
    """``(commit, dirty)`` of ``repo``: ``dirty`` is ``no``, or ``yes (N
    paths, diff sha256 XXXXXXXXXXXX)`` (the hash of ``git diff HEAD`` and of
    every untracked, not ignored file's name and contents); both ``unknown
    (why)`` when git cannot say."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    try:
        # A folder inside some other checkout is not this repository.
        if pathlib.Path(git("rev-parse", "--show-toplevel").strip()).resolve() != repo.resolve():
            return f"{UNKNOWN} (not a git checkout)", UNKNOWN
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain").splitlines()
        diff = git("diff", "HEAD") if status else ""
        untracked = sorted(p for p in git("ls-files", "--others", "--exclude-standard", "-z").split("\0") if p)
    except FileNotFoundError:
        return f"{UNKNOWN} (git not found)", UNKNOWN
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return f"{UNKNOWN} (not a git checkout)", UNKNOWN
    if not status:
        return commit, "no"
    h = hashlib.sha256(diff.encode())
    for path in untracked:  # git diff leaves them out: their names and contents count too
        h.update(b"\0" + path.encode() + b"\0")
        try:
            h.update((repo / path).read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return commit, f"yes ({len(status)} paths, diff sha256 {h.hexdigest()[:12]})"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> tuple[str, str, str]:
    try:
        # Imported here, inside the try: a JAX that fails to import still leaves a record saying so.
        import jax

        devices = jax.devices()
        return jax.default_backend(), devices[0].device_kind, str(len(devices))
    except Exception as e:  # noqa: BLE001 -- a record of a broken backend is still a record
        return f"{UNKNOWN} ({type(e).__name__})", UNKNOWN, UNKNOWN
