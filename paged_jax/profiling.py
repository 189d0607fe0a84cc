"""``--profile DIR``: a ``jax.profiler`` trace of a few engine steps after
warm-up, for the server (``python -m server --profile DIR``) and the
serving and benchmark scripts (``serve_sharegpt``, ``bench_serving``).

Why only a few steps, and not the first ones: the first steps of a run
compile their programs (seconds each, against milliseconds for a step), and
a trace of a whole run is hundreds of megabytes that Perfetto will not open.
:class:`StepProfiler` passes ``--profile-skip`` steps through untraced, then
traces ``--profile-steps`` steps, each inside a
``jax.profiler.StepTraceAnnotation("engine_step", step_num=i)`` (TensorBoard's
step view and Perfetto's slices both read it). Inside a step the engine
marks its phases (``schedule``, ``dispatch``, ``complete``:
:meth:`paged_jax.engine.core.Engine._step`), so the trace says how much of a step
is the host's scheduling, the launch, and the wait for the device's tokens.

Why it lives beside the engine: the server and the scripts both need it,
and it wraps nothing but :meth:`paged_jax.engine.core.Engine.step` (the layering
runs experiments -> server -> models -> paged_jax, and ``server`` imports
FastAPI, which a script that only profiles should not pay for).

The trace lands in ``DIR/plugins/profile/<timestamp>/``: open
``perfetto_trace.json.gz`` at https://ui.perfetto.dev, or point TensorBoard
(with ``tensorboard-plugin-profile``) at ``DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import pathlib
import types
import warnings

import jax

from paged_jax.checks import check_bool, check_int

DEFAULT_SKIP = 8
"""Steps run untraced first (``--profile-skip``): compilation happens there."""

DEFAULT_STEPS = 8
"""Steps traced (``--profile-steps``)."""


def _folder(text: str) -> pathlib.Path:
    """``--profile``'s value: a path, not empty (``Path("")`` is the current
    folder, which nobody asks for by typing nothing)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a folder path, got ''")
    return pathlib.Path(text)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """Adds ``--profile DIR``, ``--profile-skip``, ``--profile-steps`` and
    ``--profile-python``."""
    p.add_argument("--profile", type=_folder, default=None, metavar="DIR",
                   help="write a jax.profiler trace (Perfetto / TensorBoard) of a few engine steps after warm-up "
                        "to DIR")
    p.add_argument("--profile-skip", type=int, default=DEFAULT_SKIP,
                   help="engine steps run before the trace starts (default %(default)s: compilation happens there)")
    p.add_argument("--profile-steps", type=int, default=DEFAULT_STEPS,
                   help="engine steps traced (default %(default)s)")
    p.add_argument("--profile-python", action="store_true",
                   help="also trace every Python call (large traces; off by default)")


def check_profile_args(p: argparse.ArgumentParser, args) -> None:
    """Exits with an argparse error naming the flag: a negative
    ``--profile-skip``, ``--profile-steps`` below 1, or a ``--profile``
    folder that cannot be created or written (checked now: in a server the
    trace starts inside an engine step, where a failure would fail the
    engine). The folders it creates to check are removed again (a later
    refusal leaves nothing behind); the trace creates them when it starts."""
    if args.profile_skip < 0:
        p.error(f"--profile-skip must be >= 0, got {args.profile_skip}")
    if args.profile_steps < 1:
        p.error(f"--profile-steps must be >= 1, got {args.profile_steps}")
    if args.profile is not None:
        folder = args.profile.absolute()
        created = [d for d in (folder, *folder.parents) if not d.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            writable = os.access(folder, os.W_OK | os.X_OK)
        except OSError as e:
            p.error(f"--profile {str(args.profile)!r} is not a folder that can be created: {e}")
        finally:
            for d in created:  # deepest first
                if d.is_dir():
                    d.rmdir()
        if not writable:
            p.error(f"--profile {str(args.profile)!r} is not a writable folder")


def _checked(out_dir, skip, steps, python) -> tuple[pathlib.Path, int, int, bool]:
    """The profiler's settings, checked (one rule for :class:`StepProfiler`
    and :class:`ProfileSpec`)."""
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir) or "\0" in str(out_dir):
        raise ValueError(f"out_dir must be a folder path (not empty, no NUL byte), got out_dir={out_dir!r}")
    return pathlib.Path(out_dir), check_int("skip", skip, 0), check_int("steps", steps, 1), check_bool("python", python)


class StepProfiler:
    """Steps an engine like the engine itself, tracing steps
    ``[skip, skip + steps)`` into ``out_dir``.

    It has the two methods :func:`paged_jax.engine.outputs.drain` and the scripts'
    loops call (``step``, ``has_unfinished``); everything else is the
    engine's. The trace stops after its last step, or at :meth:`close`
    (also on leaving a ``with`` block) if the run ends sooner.

    Args:
      engine: a :class:`paged_jax.engine.core.Engine` (or anything with
        ``step()`` and ``has_unfinished()``).
      out_dir: the trace's folder (created).
      skip: steps before the trace starts, >= 0.
      steps: steps traced, >= 1.
      python: also trace every Python function call (JAX's Python tracer;
        off by default: it records about a million events in a few steps,
        where Perfetto's trace is cut).

    Attributes:
      traced: steps traced so far.
      failed: why the trace could not start ("" if it did or has not
        tried yet); the steps then run untraced, with a warning.

    Raises:
      ValueError: ``skip`` < 0, ``steps`` < 1 (Python or NumPy ints),
        ``python`` not a bool, ``out_dir`` not a path.
    """

    def __init__(self, engine, out_dir: str | pathlib.Path, *, skip: int = DEFAULT_SKIP, steps: int = DEFAULT_STEPS,
                 python: bool = False):
        self.engine = engine
        self.out_dir, self.skip, self.steps, self.python = _checked(out_dir, skip, steps, python)
        self.traced = 0
        self.failed = ""
        self._count = 0
        self._tracing = False

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self):
        """One engine step, traced when its turn has come."""
        i = self._count
        self._count += 1
        if i == self.skip and self.traced == 0:
            self._start()
        if not self._tracing:
            return self.engine.step()
        try:
            with jax.profiler.StepTraceAnnotation("engine_step", step_num=i):
                out = self.engine.step()
        finally:
            self.traced += 1
            if self.traced == self.steps:
                self.close()
        return out

    def _start(self) -> None:
        """Starts the trace; a failure (the folder gone or unwritable since
        the flags were checked, another trace already running) is a warning
        and ``failed`` says why: the engine's step must not fail for its
        profiler (in the server it would end serving)."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = int(self.python)  # every Python call: 1M events in a few steps
            jax.profiler.start_trace(str(self.out_dir), create_perfetto_trace=True, profiler_options=options)
        except (OSError, RuntimeError, ValueError) as e:
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"profiling: no trace written to {str(self.out_dir)!r}: {self.failed}", RuntimeWarning,
                          stacklevel=3)
            return
        self._tracing = True

    def close(self) -> None:
        """Stops the trace if it is running (idempotent)."""
        if self._tracing:
            self._tracing = False
            jax.profiler.stop_trace()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        if name == "engine":  # not set yet (copying, unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.engine, name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSpec:
    """What ``--profile`` asked for: the trace's folder and which steps.

    Raises:
      ValueError: as :class:`StepProfiler`'s.
    """

    out_dir: pathlib.Path
    skip: int = DEFAULT_SKIP
    steps: int = DEFAULT_STEPS
    python: bool = False

    def __post_init__(self):
        for name, value in zip(("out_dir", "skip", "steps", "python"),
                               _checked(self.out_dir, self.skip, self.steps, self.python)):
            object.__setattr__(self, name, value)  # NumPy ints as ints, a str folder as a Path

    @classmethod
    def from_args(cls, args) -> "ProfileSpec | None":
        """The spec of parsed ``--profile*`` flags; None without ``--profile``."""
        if args.profile is None:
            return None
        return cls(out_dir=args.profile, skip=args.profile_skip, steps=args.profile_steps, python=args.profile_python)

    def wrap(self, engine) -> StepProfiler:
        """A :class:`StepProfiler` of ``engine`` with this spec."""
        return StepProfiler(engine, self.out_dir, skip=self.skip, steps=self.steps, python=self.python)

    def install(self, engine) -> StepProfiler:
        """Makes ``engine.step`` itself trace as this spec says, for an
        engine that something else steps: the server's engine loop calls
        ``engine.step()`` and takes only an
        :class:`paged_jax.engine.core.Engine`, so a wrapper cannot stand in for
        it. Call it before anything steps ``engine``; the steps count from
        its first step after (in a server, from the first request). Close
        the returned profiler when done (the trace stops by itself after
        its last step); ``del engine.step`` undoes it."""
        inner = types.SimpleNamespace(step=engine.step, has_unfinished=engine.has_unfinished)  # the class's own
        profiler = self.wrap(inner)
        engine.step = profiler.step
        return profiler


TRACE_GLOB = "plugins/profile/*/perfetto_trace.json.gz"
"""Where under its folder a :class:`StepProfiler` run's Perfetto trace lands."""


def traces_since(out_dir: str | pathlib.Path, since: float) -> list[pathlib.Path]:
    """The Perfetto traces written under ``out_dir`` at or after ``since``
    (seconds, ``time.time()``): what a run that started then wrote (none if
    it ended before its first traced step, or its trace could not start)."""
    # File times come from the kernel's coarse clock (up to a tick, 10 ms, behind time.time()).
    return sorted(p for p in pathlib.Path(out_dir).glob(TRACE_GLOB) if p.stat().st_mtime >= since - 0.02)


def report_trace(spec: ProfileSpec, since: float) -> str:
    """The line a script prints after a profiled run that started at
    ``since``: where its trace is, or why there is none."""
    found = traces_since(spec.out_dir, since)
    if found:
        return f"wrote the trace to {found[-1]} (Perfetto, or TensorBoard on {spec.out_dir})"
    return (f"no trace written to {spec.out_dir}: the run ended within --profile-skip {spec.skip} steps, or the "
            "trace could not start (see the warning above)")


def trace_slices(path: str | pathlib.Path) -> list[dict]:
    """The complete events (Perfetto ``"ph": "X"`` slices: ``engine_step``
    with its ``args.step_num``, the engine's phases, XLA's ops) of one
    trace a :class:`StepProfiler` wrote.

    Args:
      path: the trace file (``perfetto_trace.json.gz``, the path a script
        prints), one run's folder (``DIR/plugins/profile/<run>``), or the
        ``--profile DIR`` folder when it holds one run only.

    Returns:
      the events as dicts (``name``, ``ts`` and ``dur`` in microseconds,
      ``args``, ...), in the file's order.

    Raises:
      ValueError: ``path`` is none of those (missing, empty, a folder with
        no trace, or with several runs: the message lists them, pass one),
        or the file is not a Perfetto trace.
    """
    if not isinstance(path, (str, pathlib.PurePath)) or not str(path) or "\0" in str(path):
        raise ValueError(f"path must be a non-empty str or Path without a NUL byte, got path={path!r}")
    path = pathlib.Path(path)
    if not path.exists():
        raise ValueError(f"path={str(path)!r} does not exist")
    if path.is_file():
        found = [path]
    else:
        found = sorted(path.glob(TRACE_GLOB)) or sorted(path.glob(pathlib.Path(TRACE_GLOB).name))
    if len(found) != 1:
        runs = "".join(f"\n  {p}" for p in found)
        raise ValueError(f"path={str(path)!r} must be a trace file, a run's folder, or a folder holding exactly one "
                         f"{TRACE_GLOB}; found {len(found)}" + (f" (pass one of them):{runs}" if found else ""))
    try:
        data = json.loads(gzip.decompress(found[0].read_bytes()))
        events = data["traceEvents"] if isinstance(data, dict) else data
        return [e for e in events if e.get("ph") == "X"]
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as e:  # gzip, JSON or its shape
        raise ValueError(f"{str(found[0])!r} is not a Perfetto trace (gzipped JSON with traceEvents): "
                         f"{type(e).__name__}: {e}") from None
