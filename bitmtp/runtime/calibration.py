"""Measured step costs: how long one step of width w takes at context length c, on this machine.

``policy="auto"`` decides per iteration whether drafting pays: expected committed tokens of a wide
step against what that width costs relative to a width-1 (AR) step. That ratio depends on everything
below the decode loop — the model's shape, the kernel backend and its ISA path, the thread count, the
CPU or GPU, CUDA graphs or eager steps — so it is measured, not modelled: :func:`measure_cost_table`
times real verify steps of the engine's own step pool over a grid of widths and contexts, and
:func:`load_cost_table` keeps the result in a cache file per :func:`calibration_key`, re-measuring
when the file cannot be trusted (never crashing on it: a bad cache costs one measurement).

Cache files live in ``<cache_dir()>/calibration/<sha256(key JSON)[:16]>.json``; they are written to a
temporary file in the same folder and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from bitmtp.decoding.auto import STEP_TIMES_KEPT_S
from bitmtp.errors import BitMTPError
from bitmtp.model.adapters import base_fingerprint
from bitmtp.model.layers import DenseLinear
from bitmtp.ops import registry
from bitmtp.ops.backends.cpu_backend import ISA_NAMES
from bitmtp.ops.fused_layers import fused_enabled
from bitmtp.ops.ternary_linear import TernaryLinear
from bitmtp.runtime.states import ReplayState

log = logging.getLogger("bitmtp")

#: bump when the file layout or the meaning of a measurement changes: older files are then rebuilt
SCHEMA_VERSION = 1
#: environment variable naming the cache folder (else ``$XDG_CACHE_HOME/bitmtp``, else ``~/.cache/bitmtp``)
CACHE_ENV = "BITMTP_CACHE_DIR"

#: Default widths (plus the engine's m_max): dense up to 4, where drafting pays on a CPU, sparse above, where
#: the cost is close to linear in width. Measured on SmolLM2-135M, 2 threads, AMD EPYC (ms per step, context
#: 128 / 1024): w4 21.3 / 57.1, w6 32.8 / 78.8, w8 45.9 / 104.1, w12 58.6 / 153.7, w16 82.4 / 196.3 —
#: interpolating w6 from w4..w8 is 2 % off, w12 from w8..w16 10 % / 2 %; dropping w5, w10, w12 keeps a
#: default calibration near 5 s (every width is timed 4 times at every context, the widest the most costly).
DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 16)
#: Default contexts (clipped to the engine's capacity): attention grows with the rows attended, so the
#: relative cost of a wide step drifts with depth (SmolLM2 above: w16 7.7x a width-1 step at 128, 9.2x at
#: 1024). Two points; beyond 1024 the table extrapolates linearly (width-1 cost at 128 / 1024 / 2017:
#: 9.3 / 17.5 / 25.0 ms, close to linear). A third context at 2017 tripled the calibration time.
DEFAULT_CONTEXTS = (128, 1024)
#: Default repeats per (width, context) after one warm-up step each.
DEFAULT_REPEATS = 3

#: A cached table whose longer context costs less than this fraction of a shorter one (same width) is
#: rejected: a measurement is stored monotone in context, so such a file was edited or corrupted.
_WILD_CONTEXT_DROP = 0.5
#: A step whose median timing exceeds its fastest by this factor was slowed by other work on the cores (a
#: median survives one slowed repeat, not most of them): warned about. SmolLM2-135M, 2 threads, idle machine:
#: median/fastest <= 1.35 in every cell; with another process busy on the same two cores, up to 30x (a
#: width-1 median of 196 ms against 10 ms idle).
_BUSY_SPREAD = 2.0

#: The physical range of one step's seconds, in a table read from a cache file and in what LiveCosts
#: observes: a measurement stores at least 1 ns (its floor), and no decode step of a model this loads takes
#: an hour. Anything outside was edited or corrupted — and the planning arithmetic would not survive it:
#: 1e308 overflows to inf when extrapolated past the last context (inf - inf = nan, then a division by a
#: zero width-1 cost), 5e-324 divides to inf. Inside the range every interpolation, extrapolation (t <=
#: capacity) and ratio stays finite and positive.
MIN_STEP_SECONDS = 1e-9
MAX_STEP_SECONDS = 3600.0

#: the decoder attribute holding its fingerprint (hashing weights on every key would cost ~ms per call)
_FP_ATTR = "_bitmtp_calibration_fingerprint"

_LOCK = threading.Lock()  # one load/measure at a time: concurrent measurements would time each other
_MEMO: dict[tuple[str, str], CostTable] = {}  # (cache file, key JSON) -> table


class CalibrationError(BitMTPError):
    """A calibration table (a cache file or a dict) that cannot be trusted; the message says why."""


# --------------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class CostTable:
    """Seconds of one step of width w (query rows) at a context length c (KV rows attended), measured on
    this machine for this model, backend, runtime and thread count.

    ``seconds[ci][wi]`` is the median time of a width ``widths[wi]`` step at context ``contexts[ci]``,
    including the one device→host read a real iteration makes. :meth:`step_seconds` interpolates
    piecewise-linearly in width and context; it is monotone non-decreasing in width (a running
    maximum over the measured widths, so noise never makes a wider step look cheaper).
    """

    widths: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    key: dict = field(hash=False)

    @cached_property
    def _rows(self) -> list[list[float]]:
        """Per context, the seconds made non-decreasing in width (running maximum)."""
        rows = []
        for row in self.seconds:
            out, top = [], 0.0
            for s in row:
                top = max(top, float(s))
                out.append(top)
            rows.append(out)
        return rows

    def _row_at(self, context: float) -> list[float]:
        """Seconds per measured width at ``context``: linear between measured contexts, the first row
        below the first context, linear extrapolation (never decreasing) beyond the last."""
        rows, cs = self._rows, self.contexts
        if len(cs) == 1 or context <= cs[0]:
            return rows[0]
        i = bisect_right(cs, context) - 1
        if i >= len(cs) - 1:  # beyond the last: extend the last segment's per-width slope (clamped at 0)
            lo, hi, t = rows[-2], rows[-1], (context - cs[-1]) / (cs[-1] - cs[-2])
            row = [h + t * max(0.0, h - lo_) for lo_, h in zip(lo, hi, strict=True)]
            top = 0.0
            for j, s in enumerate(row):  # per-width slopes differ: restore monotonicity in width
                top = row[j] = max(top, s)
            return row
        t = (context - cs[i]) / (cs[i + 1] - cs[i])
        return [a + t * (b - a) for a, b in zip(rows[i], rows[i + 1], strict=True)]

    def step_seconds(self, width: int, context: int) -> float:
        """Seconds of one step of ``width`` rows at ``context`` attended rows (interpolated; beyond the
        last measured width or context, extrapolated linearly and never decreasing)."""
        if not width >= 1:
            raise BitMTPError(f"width: a step has at least 1 row, got {width}")
        if not context >= 0:
            raise BitMTPError(f"context: must be >= 0, got {context}")
        row, ws = self._row_at(context), self.widths
        if len(ws) == 1:
            return row[0]
        i = min(bisect_right(ws, width) - 1, len(ws) - 2)  # the segment [ws[i], ws[i+1]] (the last one beyond)
        t = (width - ws[i]) / (ws[i + 1] - ws[i])
        return row[i] + t * (row[i + 1] - row[i])

    def relative(self, width: int, context: int) -> float:
        """The cost of a width-``width`` step relative to a width-1 step at the same context (>= 1)."""
        return self.step_seconds(width, context) / self.step_seconds(1, context)

    def as_dict(self) -> dict:
        """A JSON-able dict (the cache file's content); :meth:`from_dict` reads it back."""
        return {"schema": SCHEMA_VERSION, "widths": list(self.widths), "contexts": list(self.contexts),
                "seconds": [list(r) for r in self.seconds], "key": self.key}

    @classmethod
    def from_dict(cls, d: Any) -> CostTable:
        """The table of :meth:`as_dict`'s dict, validated; raises :class:`CalibrationError` saying what is
        wrong (another schema, missing or malformed fields, non-finite or non-positive seconds, seconds
        outside :data:`MIN_STEP_SECONDS` .. :data:`MAX_STEP_SECONDS`, widths
        not starting at 1, unsorted grids, a longer context measured wildly cheaper than a shorter one)."""
        if not isinstance(d, dict):
            raise CalibrationError(f"expected a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA_VERSION:
            raise CalibrationError(f"schema {d.get('schema')!r}, this bitmtp reads schema {SCHEMA_VERSION}")
        for name in ("widths", "contexts", "seconds", "key"):
            if name not in d:
                raise CalibrationError(f"field {name!r} is missing")
        widths = _int_grid("widths", d["widths"], minimum=1)
        if widths[0] != 1:
            raise CalibrationError(f"widths must start at 1, got {list(widths)}")
        contexts = _int_grid("contexts", d["contexts"], minimum=0)
        rows = d["seconds"]
        if not isinstance(rows, list) or len(rows) != len(contexts):
            raise CalibrationError(f"seconds: expected {len(contexts)} rows (one per context)")
        seconds = []
        for ci, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(widths):
                raise CalibrationError(f"seconds[{ci}]: expected {len(widths)} values (one per width)")
            for wi, s in enumerate(row):
                if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                    raise CalibrationError(f"seconds[{ci}][{wi}] (width {widths[wi]}, context {contexts[ci]}) "
                                           f"is {s!r}; expected a finite positive number")
                if not MIN_STEP_SECONDS <= s <= MAX_STEP_SECONDS:
                    raise CalibrationError(f"seconds[{ci}][{wi}] (width {widths[wi]}, context {contexts[ci]}) "
                                           f"is {s!r}; a step costs between {MIN_STEP_SECONDS:g} s (1 ns) and "
                                           f"{MAX_STEP_SECONDS:g} s (1 hour)")
            seconds.append(tuple(float(s) for s in row))
        for ci in range(1, len(seconds)):
            for wi, w in enumerate(widths):
                if seconds[ci][wi] < _WILD_CONTEXT_DROP * seconds[ci - 1][wi]:
                    raise CalibrationError(
                        f"width {w}: context {contexts[ci]} costs {seconds[ci][wi]:.3g} s, less than half of "
                        f"context {contexts[ci - 1]} ({seconds[ci - 1][wi]:.3g} s)")
        if not isinstance(d["key"], dict):
            raise CalibrationError("key: expected a JSON object")
        return cls(widths, contexts, tuple(seconds), d["key"])


def _int_grid(name: str, v: Any, *, minimum: int) -> tuple[int, ...]:
    if (not isinstance(v, list) or not v
            or any(isinstance(x, bool) or not isinstance(x, int) or x < minimum for x in v)):
        raise CalibrationError(f"{name}: expected a non-empty list of integers >= {minimum}, got {v!r}")
    if any(b <= a for a, b in zip(v, v[1:], strict=False)):
        raise CalibrationError(f"{name}: must be strictly ascending, got {v!r}")
    return tuple(v)


# --------------------------------------------------------------------------------------------------
# what a table depends on


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _fingerprint(decoder: Any) -> str:
    fp = getattr(decoder, _FP_ATTR, None)
    if fp is None:
        fp = base_fingerprint(decoder)
        setattr(decoder, _FP_ATTR, fp)
    return fp


def _kernels(decoder: Any) -> dict:
    """The kernel backend the decoder's steps run on: the requested or automatic backend, the backends
    pinned on its linear layers, whether the fused native CPU layers run, and the native ISA path."""
    dev = decoder.device
    requested = registry.requested_backend(decoder.backend)
    if requested is None:  # the registry's automatic choice: the first available backend for the device
        requested = next((n for n in registry.PREFERENCE.get(dev.type, ("torch",))
                          if n in registry.backend_names() and registry.availability(n, dev)[0]), "torch")
    # one walk over the modules (~1 ms on SmolLM2's 30 layers, once per load_cost_table call)
    pinned: set[str] = set()
    dense: dict[str, int] = {}
    for m in decoder.modules():
        if isinstance(m, (DenseLinear, TernaryLinear)):  # the modules that carry a backend
            if m.backend is not None:
                pinned.add(str(m.backend))
            if isinstance(m, DenseLinear):
                fmt = m.blocks.fmt if m.blocks is not None else "float"
                dense[fmt] = dense.get(fmt, 0) + 1
    fused, _ = fused_enabled(dev, decoder.backend)
    isa, openmp, build = None, None, None
    if requested == "cpu" or fused:
        cpu = registry.backend("cpu") if "cpu" in registry.backend_names() else None
        if cpu is not None:
            features = getattr(cpu, "features", {})
            openmp = features.get("openmp")
            build = _native_build(getattr(getattr(cpu, "_ext", None), "__file__", None))
            try:
                code = cpu._isa()  # -1: the best path CPUID found
            except BitMTPError:  # a bad BITMTP_CPU_ISA: the step itself will raise it
                code = -1
            names = {v: k for k, v in ISA_NAMES.items()}
            isa = features.get("best") if code < 0 else names.get(code, str(code))
    return {"backend": requested, "pinned": sorted(pinned), "fused": bool(fused), "isa": isa, "openmp": openmp,
            "build": build, "dense": dict(sorted(dense.items()))}


@functools.lru_cache(maxsize=8)
def _native_build_of(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _native_build(path: str | None) -> str | None:
    """A hash of the native extension's file: a rebuilt kernel (same bitmtp version, other speeds; e.g. an
    editable install after a kernel change) makes a cached cost table stale. ~3 ms once per file version."""
    if not path:
        return None
    try:
        st = os.stat(path)
        return _native_build_of(path, st.st_size, st.st_mtime_ns)
    except OSError:
        return None


def _device_name(engine: Any) -> str:
    dev = engine.decoder.device
    if engine.runtime == "vulkan":  # the Vulkan adapter the step pool opened
        info = getattr(getattr(getattr(engine.pool, "model", None), "r", None), "info", None) or {}
        return str(info.get("device") or info.get("description") or "vulkan")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return _cpu_model()


def calibration_key(engine: Any) -> dict:
    """What a cost table depends on (JSON-able; equal keys mean a cached table applies): the model's
    fingerprint and shape, dtype and device, runtime, kernel backend, CPU ISA path and native build, CUDA graphs or
    eager, thread count, CPU model, torch and bitmtp versions, the KV store's m_max and capacity, and the
    file schema. The decoder's fingerprint (a hash of weights) is computed once and kept on it."""
    dec = engine.decoder
    a = dec.args
    pkg = sys.modules.get("bitmtp")  # the parent package (always imported first); not an upward import
    return {
        "schema": SCHEMA_VERSION,
        "model": _fingerprint(dec),
        "shape": [str(a.family), a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads,
                  a.head_dim, a.vocab_size],
        "dtype": str(dec.dtype).removeprefix("torch."),
        "device": str(dec.device),
        "device_name": _device_name(engine),
        "runtime": engine.runtime,
        "gpu_layers": getattr(engine, "_config", {}).get("gpu_layers"),
        "graphs": bool(getattr(engine.pool, "capture", False)),
        "kernels": _kernels(dec),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "bitmtp": str(getattr(pkg, "__version__", "unknown")),
        "m_max": engine.kv.m_max,
        # contexts are clipped to capacity: a table from a small store would be extrapolated far
        "capacity": engine.capacity,
    }


def _key_json(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------------------------------
# measuring


def _widths(engine: Any, widths: Any) -> tuple[int, ...]:
    m_max = engine.kv.m_max
    if widths is None:
        ws = {w for w in DEFAULT_WIDTHS if w <= m_max} | {m_max}
    else:
        ws = set()
        for w in widths:
            if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= m_max:
                raise BitMTPError(f"widths: each must be an integer in 1..{m_max} (the engine's m_max), got {w!r}")
            ws.add(w)
        ws.add(1)  # relative() divides by width 1
    return tuple(sorted(ws))


def _contexts(engine: Any, contexts: Any, widest: int) -> tuple[int, ...]:
    top = engine.capacity - widest  # a step writes rows [c, c + w): they must fit the store
    if top < 0:
        raise BitMTPError(f"widths: a width-{widest} step does not fit capacity {engine.capacity}")
    cs = DEFAULT_CONTEXTS if contexts is None else tuple(contexts)
    out = set()
    for c in cs:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise BitMTPError(f"contexts: each must be an integer >= 0, got {c!r}")
        out.add(min(c, top))
    if not out:
        raise BitMTPError("contexts: at least one context length is needed")
    return tuple(sorted(out))


def measure_cost_table(engine: Any, *, widths: Any = None, contexts: Any = None, repeats: int = DEFAULT_REPEATS,
                       progress: bool = False) -> CostTable:
    """Time real verify steps of ``engine``'s step pool: a :class:`CostTable` of median seconds.

    For every (context c, width w) it fills the runner of ``ReplayState(w, segment_for(c + w), "verify")``
    with fixed random token ids at positions ``[c, c + w)``, runs it and reads its tokens through
    ``engine.read`` (a real iteration's read). One warm-up step per state, then ``repeats`` rounds
    over all states, alternating direction (noise and drift land on every state alike); the median per
    state is kept, made non-decreasing in width and in context (a slower sample is noise: more rows
    never cost less).

    The steps write KV rows ``[c, c + w)`` and attend rows ``[0, c)`` whatever they hold; afterwards
    ``engine.n`` is 0, so the caller must own the store (the decode loop calls this inside its
    generation, before the prefill). ``engine.syncs`` is left as it was: it counts the decode loop's
    reads, and these are not part of it.

    Args:
        widths: widths to time (default :data:`DEFAULT_WIDTHS` up to the engine's m_max, plus m_max;
            1 is always included).
        contexts: context lengths (default :data:`DEFAULT_CONTEXTS`), clipped so that ``c + max(widths)``
            fits the capacity, deduplicated.
        repeats: timed steps per state (>= 1).
        progress: show a tqdm progress bar.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BitMTPError(f"repeats: expected an integer >= 1, got {repeats!r}")
    ws = _widths(engine, widths)
    cs = _contexts(engine, contexts, ws[-1])
    key = calibration_key(engine)
    dec = engine.decoder
    g = torch.Generator().manual_seed(0x5EED)
    ids = torch.randint(0, dec.args.vocab_size, (ws[-1],), generator=g).to(dec.device)
    cells = [(ci, wi) for ci in range(len(cs)) for wi in range(len(ws))]
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    syncs = engine.syncs
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cells) * (repeats + 1), desc="bitmtp: calibrating step costs", unit="step",
                   leave=False)
    t_start = time.perf_counter()
    try:
        runners = {}
        for ci, wi in cells:
            c, w = cs[ci], ws[wi]
            runners[ci, wi] = engine.pool.get(ReplayState(w, engine.kv.segment_for(c + w), "verify"))

        def step(cell: tuple[int, int]) -> float:
            (ci, wi), runner = cell, runners[cell]
            c, w = cs[ci], ws[wi]
            t0 = time.perf_counter()
            runner.feed(ids[:w], c)
            runner.run()
            engine.read(runner.out_token[:w])
            dt = time.perf_counter() - t0
            if bar is not None:
                bar.update()
            return dt

        with torch.no_grad():
            for cell in cells:  # warm-up: allocations, lazy plans, CUDA graph capture
                step(cell)
            for r in range(repeats):
                for cell in (cells if r % 2 == 0 else cells[::-1]):
                    samples[cell].append(step(cell))
    finally:
        engine.reset()  # n = 0, and no prompt prefix is reused: these steps wrote rows anywhere
        engine.syncs = syncs
        if bar is not None:
            bar.close()
    # a median far above the fastest timing of its step: most of that step's repeats were slowed down
    spread = max(statistics.median(v) / max(min(v), 1e-9) for v in samples.values())
    if spread > _BUSY_SPREAD:
        log.warning("bitmtp: step costs were measured on a busy machine (a step's median timing is %.1fx its "
                    "fastest); policy='auto' may choose badly with them: rebuild the table on an idle machine "
                    "(load_cost_table(engine, rebuild=True))", spread)
    # clamped to the range a cache file is read back with (a table this writes must load again)
    grid = [[min(max(statistics.median(samples[ci, wi]), MIN_STEP_SECONDS), MAX_STEP_SECONDS)
             for wi in range(len(ws))] for ci in range(len(cs))]
    for ci in range(len(cs)):
        for wi in range(len(ws)):
            grid[ci][wi] = max(grid[ci][wi], grid[ci][wi - 1] if wi else 0.0, grid[ci - 1][wi] if ci else 0.0)
    log.info("bitmtp: measured step costs of %d widths x %d contexts in %.2f s", len(ws), len(cs),
             time.perf_counter() - t_start)
    return CostTable(ws, cs, tuple(tuple(r) for r in grid), key)


# --------------------------------------------------------------------------------------------------
# the cache


def cache_dir() -> Path:
    """bitmtp's cache folder: ``$BITMTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/bitmtp``, else ``~/.cache/bitmtp``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return Path(xdg).expanduser() / "bitmtp"
    return Path.home() / ".cache" / "bitmtp"


def cache_path(key: dict, cache: Path | None = None) -> Path:
    """The file holding the table of ``key``: ``<cache>/calibration/<sha256 of the key's JSON>[:16].json``."""
    digest = hashlib.sha256(_key_json(key).encode()).hexdigest()[:16]
    return Path(cache if cache is not None else cache_dir()) / "calibration" / f"{digest}.json"


def clear_memo() -> None:
    """Forget the tables memoised in this process (the next load reads the cache file again)."""
    with _LOCK:
        _MEMO.clear()


def _key_diff(stored: Any, key: dict) -> str:
    if not isinstance(stored, dict):
        return "the stored key is not an object"
    fields = sorted(k for k in set(stored) | set(key)
                    if _key_json({"v": stored.get(k)}) != _key_json({"v": key.get(k)}))
    return "it was measured for another " + ", ".join(fields)


def _read(path: Path, key: dict, m_max: int, measure: bool = True) -> CostTable | None:
    """The trusted table in ``path``, or None (missing: silently; untrusted: a warning naming the file, why,
    and what happens next — re-measured now when ``measure``, else the prior costs until it is)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # nothing cached (yet): no news
        return None
    except (OSError, UnicodeDecodeError) as exc:
        reason = f"unreadable ({exc})"
    else:
        try:
            table = CostTable.from_dict(json.loads(text))
            if _key_json(table.key) != _key_json(key):
                raise CalibrationError(_key_diff(table.key, key))
            if table.widths[-1] < m_max:
                raise CalibrationError(f"its widths {list(table.widths)} do not cover 1..{m_max} (the engine's m_max)")
            return table
        except json.JSONDecodeError as exc:
            reason = f"not valid JSON ({exc})"
        except CalibrationError as exc:
            reason = str(exc)
    if measure:
        log.warning("bitmtp: calibration cache %s cannot be trusted: %s; rebuilding it", path, reason)
    else:  # a short generation does not measure: say how the file gets replaced
        log.warning("bitmtp: calibration cache %s cannot be trusted: %s; planning with default step costs until "
                    "a generation long enough to calibrate re-measures them (or delete the file, or run "
                    "`bitmtp info --model PATH --calibrate`)", path, reason)
    return None


def _write(path: Path, table: CostTable) -> None:
    """Write ``table`` to ``path`` atomically (temporary file in the same folder + rename); an unwritable
    cache is logged, never raised (the table is still used, just not kept)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(table.as_dict(), f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        log.warning("bitmtp: cannot write the calibration cache %s (%s); using the measured step costs "
                    "without caching them (set %s to a writable folder)", path, exc, CACHE_ENV)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def prior_cost_table(engine: Any) -> CostTable:
    """A table to plan with before anything was measured: a step of width w costs 1 + 0.25·(w − 1) width-1
    steps at any context (what a 2-core CPU measures for SmolLM2; llama.cpp: 1.24 / 1.77 / 2.97 at w = 2 /
    4 / 8). Its seconds are nominal: :class:`LiveCosts` scales them by what the steps are seen to take."""
    widths = tuple(sorted(set(DEFAULT_WIDTHS) | {int(engine.kv.m_max)}))
    row = tuple(0.01 * (1 + 0.25 * (w - 1)) for w in widths)
    return CostTable(widths, DEFAULT_CONTEXTS, (row, row), {"prior": "1 + 0.25 (w - 1)"})


def load_cost_table(engine: Any, *, rebuild: bool = False, progress: bool = False,
                    cache: Path | None = None, measure: bool = True) -> CostTable | None:
    """The step-cost table of ``engine``: memoised in this process, else read from the cache file of its
    :func:`calibration_key`, else measured (:func:`measure_cost_table`, which resets ``engine.n``: the
    caller owns the KV store) and written there.

    A cache file is never trusted blindly: one that is unreadable, not JSON, truncated, of another
    schema, for another key, with missing, non-finite, non-positive or out-of-range values (a step
    between 1 ns and 1 hour: :data:`MIN_STEP_SECONDS`, :data:`MAX_STEP_SECONDS`), or whose widths do not
    reach the engine's m_max is reported (a warning on the ``bitmtp`` logger naming the file and why),
    re-measured and rewritten. An unwritable cache folder is reported once and the measured table is
    still returned (and memoised). ``rebuild=True`` measures and rewrites regardless. Thread-safe: one
    load or measurement runs at a time in a process.

    Args:
        cache: the cache folder (default :func:`cache_dir`).
        measure: False — return None instead of measuring when no valid table is memoised or cached
            (a short generation does not pay a calibration: the decode loop plans with
            :func:`prior_cost_table` then).
    """
    key = calibration_key(engine)
    path = cache_path(key, cache)
    memo_key = (str(path), _key_json(key))
    with _LOCK:
        table = None if rebuild else _MEMO.get(memo_key)
        if table is None:
            if not rebuild:
                table = _read(path, key, engine.kv.m_max, measure)
            if table is None:
                if not measure:
                    return None
                table = measure_cost_table(engine, progress=progress)
                _write(path, table)
            _MEMO[memo_key] = table
        return table


# --------------------------------------------------------------------------------------------------
# reporting


def format_cost_table(table: CostTable) -> str:
    """The table as text (``bitmtp info``): a row per context, a column per width, each cell the cost
    relative to a width-1 step at that context, and the width-1 step in milliseconds."""
    head = f"{'context':>7} {'w1 ms':>7} " + " ".join(f"{'w' + str(w):>5}" for w in table.widths)
    lines = ["step cost relative to width 1 (measured):", head]
    for c in table.contexts:
        cells = " ".join(f"{table.relative(w, c):5.2f}" for w in table.widths)
        lines.append(f"{c:>7} {1e3 * table.step_seconds(1, c):7.2f} {cells}")
    return "\n".join(lines)


__all__ = [
    "SCHEMA_VERSION",
    "CACHE_ENV",
    "DEFAULT_WIDTHS",
    "DEFAULT_CONTEXTS",
    "DEFAULT_REPEATS",
    "CostTable",
    "CalibrationError",
    "calibration_key",
    "measure_cost_table",
    "cache_dir",
    "cache_path",
    "clear_memo",
    "load_cost_table",
    "prior_cost_table",
    "format_cost_table",
]


# --------------------------------------------------------------------------------------------------
# during a generation


class LiveCosts:
    """The table's step costs, corrected by the step times a generation observes.

    A table measured while other work shared the cores, or a machine whose load changed since, would
    make ``auto`` plan with wrong costs for as long as the cache lives. So the decode loop times every
    step it runs (the step and its one read) and this keeps the last :attr:`WINDOW` times per width
    observed within the last :data:`~bitmtp.decoding.auto.STEP_TIMES_KEPT_S` seconds; a width with at
    least :attr:`MIN_SEEN` such times costs the median of them (a median, not a mean: one step slowed 20x
    by another process must not make every wider step look free); any other width costs the table's
    seconds scaled by the median observed/table ratio of the widths that were seen. Costs are kept
    non-decreasing in width. :meth:`relative` is what ``PassContext.costs`` holds.

    Times expire because a width ``auto`` stops choosing is not timed again: two width-2 steps slowed 6x by a
    browser rendering the stream on the same two cores priced width 2 at 5.4 AR steps for every later request
    of that server session, so a prompt its answer repeats was decoded token by token. Expired, the width
    costs the table's seconds at the current scale again, and is re-timed if chosen. ``clock``: seconds
    (``time.monotonic``; tests pass their own).
    """

    WINDOW = 9
    MIN_SEEN = 3

    def __init__(self, table: CostTable, m_max: int, *, clock: Any = time.monotonic):
        self.table, self.m_max = table, int(m_max)
        self.clock = clock
        self.seen: dict[int, deque[tuple[float, float]]] = {}  # width -> its last WINDOW (time, step seconds)
        self.drafts_seen: deque[tuple[float, float]] = deque()  # the last WINDOW (time, cost of one off-row draft)
        self._rows: dict[int, list[float]] = {}  # context // 16 -> the table's seconds by width

    def _fresh(self, times: deque[tuple[float, float]], now: float) -> list[float]:
        """``times`` without the entries older than STEP_TIMES_KEPT_S (dropped), as values."""
        while times and now - times[0][0] > STEP_TIMES_KEPT_S:
            times.popleft()
        return [v for _, v in times]

    def observe(self, width: int, seconds: float) -> None:
        times = self.seen.setdefault(width, deque())
        # a timer delta of 0 (a coarse clock) or a step stalled for hours (a suspended laptop) must not make
        # a cost 0 or the ratios below overflow: kept in the range a table holds
        times.append((self.clock(), min(max(float(seconds), MIN_STEP_SECONDS), MAX_STEP_SECONDS)))
        if len(times) > self.WINDOW:
            times.popleft()

    def observe_drafts(self, rows: int, drafts: int, seconds: float, context: int) -> None:
        """A step of ``rows`` rows that also drafted ``drafts`` tokens off the rows (draft heads) took
        ``seconds``: what it took beyond a step of ``rows`` rows, per draft, relative to a width-1 step,
        is one sample of :meth:`draft_cost`."""
        est = self.seconds(context)
        seconds = min(max(float(seconds), MIN_STEP_SECONDS), MAX_STEP_SECONDS)  # as observe() keeps it
        extra = max(0.0, seconds - est[min(rows, self.m_max) - 1]) / max(1, drafts) / est[0]
        self.drafts_seen.append((self.clock(), extra))
        if len(self.drafts_seen) > self.WINDOW:
            self.drafts_seen.popleft()

    def draft_cost(self, prior: float) -> float:
        """One off-row draft's cost relative to a width-1 step: the median of the last observations once
        :attr:`MIN_SEEN` were made, else ``prior``."""
        fresh = self._fresh(self.drafts_seen, self.clock())
        if len(fresh) < self.MIN_SEEN:
            return float(prior)
        return statistics.median(fresh)

    def relative(self, context: int) -> list[float]:
        """``costs[w]`` for w = 1..m_max relative to width 1 (``costs[0]`` is unused, 0.0)."""
        est = self.seconds(context)
        return [0.0] + [v / est[0] for v in est]

    def _table_row(self, context: int) -> list[float]:
        """The table's seconds for widths 1..m_max at ``context``, cached per 16 rows of context (the
        interpolation over all widths took ~0.8 ms, once per 8 iterations: ~1 % of a SmolLM2 step)."""
        bucket = int(context) // 16
        row = self._rows.get(bucket)
        if row is None:
            if len(self._rows) > 4096:
                self._rows.clear()
            at = bucket * 16
            row = self._rows[bucket] = [self.table.step_seconds(w, at) for w in range(1, self.m_max + 1)]
        return row

    def seconds(self, context: int) -> list[float]:
        """Estimated step seconds for widths 1..m_max (index w − 1) at ``context``: finite and positive for
        any table whose seconds lie in :data:`MIN_STEP_SECONDS` .. :data:`MAX_STEP_SECONDS` (every table a
        cache file or a measurement gives), so :meth:`relative` never divides by zero."""
        tab = self._table_row(context)
        now = self.clock()
        fresh = {w: self._fresh(t, now) for w, t in self.seen.items() if w <= self.m_max}
        med = {w: statistics.median(t) for w, t in fresh.items() if len(t) >= self.MIN_SEEN}
        ratios = sorted(v / tab[w - 1] for w, v in med.items())
        scale = ratios[len(ratios) // 2] if ratios else 1.0
        est, top = [], 0.0
        for w in range(1, self.m_max + 1):
            top = max(top, med.get(w, tab[w - 1] * scale))
            est.append(top)
        return est
