"""The ``cuda`` backend: W2A8 kernels in CUDA C++ (``csrc/cuda``), compiled at run time by NVRTC
through CuPy.

Two kernels share the contract of :mod:`bitmtp.ops.reference` (exact int32 accumulators, fused
scale epilogue):

* ``w2a8_decode_kernel<M, R, VEC>`` — widths M = 1..16, one instantiation per width: each packed
  weight word is loaded once (128-bit loads when rows are 16-byte aligned, ``VEC = 4``; coalesced
  32-bit loads otherwise, ``VEC = 1``), decoded once in registers and applied to all M tokens with
  ``__dp4a``; R rows per warp, scale groups reduced exactly over aligned lane segments.
* ``w2a8_tiled_kernel`` — prefill widths M ≥ 17 (and scale-group sizes the decode kernel's lane
  segments cannot cover exactly): 64×64 shared-memory tiles, ``__dp4a``, one thread per 4×4 outputs.

The choice of kernel and its run-time parameters is a pure function (:func:`plan_w2a8`), separate
from the launch, so it can be read and checked without a GPU.

Launches go to torch's current stream through CuPy's view of it, with the tensors' raw pointers, so
a ``torch.cuda.graph`` capture records them like any torch kernel. Modules are compiled lazily, one
per (device, kernel instantiation), and kept for the life of the process (CuPy also caches the
binaries on disk, under ``~/.cupy/kernel_cache``). CuPy is imported, and the M = 1 kernel built as a
probe, when availability is first checked on a CUDA device; importing this module or creating the
backend needs neither CuPy nor a GPU.

Sources are looked up in order in ``$BITMTP_CUDA_SRC``, ``<bitmtp package>/_csrc/cuda`` (where a
wheel installs them) and ``<repository>/csrc/cuda`` (an editable install or a source checkout).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bitmtp.errors import BackendUnavailableError, DeviceError, DTypeError, LayoutError, ShapeError

#: Environment variable naming a directory that holds the ``.cu`` sources (searched first).
SRC_ENV = "BITMTP_CUDA_SRC"
SOURCES = ("w2a8_common.cuh", "w2a8_decode.cu", "w2a8_tiled.cu")
_COMMON_INCLUDE = '#include "w2a8_common.cuh"'
#: NVRTC options; the sources avoid every system header, so nothing else is needed.
NVRTC_OPTIONS = ("-std=c++17",)
CUPY_HINT = ("pip install 'bitmtp[cuda13]' for a CUDA 13 torch, 'bitmtp[cuda12]' for CUDA 12 "
             "(torch.version.cuda says which)")
#: Built when availability is first checked on a device, to prove NVRTC works there.
PROBE_KERNEL = "w2a8_decode_kernel<1,4,4>"

# Kernel flags: keep in sync with csrc/cuda/w2a8_common.cuh.
FLAG_HAS_BIAS = 1
FLAG_WRITE_ACC = 2
FLAG_WRITE_OUT = 4
FLAG_OUT_BF16 = 8
FLAG_X_VEC16 = 16

# Geometry: keep in sync with the #defines of the .cu files.
DECODE_MAX_WIDTH = 16
DECODE_WARPS = 4  # DEC_WARPS
DECODE_THREADS = 32 * DECODE_WARPS
TILE_M = 64  # TL_BM
TILE_N = 64  # TL_BN
TILE_THREADS = 256
#: ``flush_every`` for a single scale group: never flush before the last step.
_FLUSH_AT_END = 1 << 30
_INT32_MAX = 2**31 - 1
_MAX_K = 1 << 30  # keeps every int32 index expression of the kernels (16·words, …) in range
_MAX_GRID_Y = 65535

#: Output dtypes the kernels store directly; others go through a float32 buffer and ``.to``.
DIRECT_OUT_DTYPES = (torch.float32, torch.bfloat16)


def rows_per_warp(m: int, n: int | None = None, sm_count: int | None = None) -> int:
    """Output rows per warp of the decode kernel for width ``m`` (its template argument R).

    Four rows amortize each activation load over more weights when the M×R accumulators are few;
    from M = 5 on two rows keep them (plus their float partial outputs) in registers without spills.
    Given the output rows ``n`` and the device's ``sm_count``, widths up to 4 drop to two rows when
    four would give fewer than two blocks per SM: with 16-row blocks a 2560-row matrix makes 160
    blocks on a 132-SM H100/H200, so some SMs would run two blocks while most run one.
    """
    r = 4 if m <= 4 else 2
    if r == 4 and n is not None and sm_count and -(-n // (DECODE_WARPS * r)) < 2 * sm_count:
        r = 2
    return r


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: which instantiation, its grid, and its int32 arguments.

    The kernels take seven pointers ``(x_q, act_scale, packed, scales, bias, out, acc_out)`` followed
    by :attr:`scalars`.
    """

    source: str  # file under csrc/cuda
    name: str  # NVRTC name expression, e.g. "w2a8_decode_kernel<8,2,4>"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    scalars: tuple[int, ...]


def decode_layout(
    kw: int, n_groups: int, group_size: int, rows_aligned16: bool
) -> tuple[int, int, int, int, int] | None:
    """How the decode kernel covers a row: ``(VEC, U, V, seg, flush_every)`` or ``None``.

    A unit is the VEC words one lane takes per step; a row has U units; a scale group has V units
    and is reduced exactly over segments of ``seg`` lanes every ``flush_every`` steps (see
    csrc/cuda/w2a8_decode.cu). ``None`` when no layout covers the group size exactly (e.g. G = 48,
    three words per group): the tiled kernel runs instead.
    """
    gw = kw if n_groups == 1 else group_size // 16
    vecs = (4, 1) if rows_aligned16 and kw % 4 == 0 else (1,)
    for vec in vecs:
        if gw % vec:
            continue
        u = kw // vec
        if n_groups == 1:
            return vec, u, u, 32, _FLUSH_AT_END
        v = gw // vec
        if v <= 32 and v & (v - 1) == 0:
            return vec, u, v, v, 1
        if v % 32 == 0:
            return vec, u, v, 32, v // 32
    return None


def plan_w2a8(
    m: int,
    n: int,
    k: int,
    group_size: int,
    *,
    shared_scales: bool,
    flags: int,
    rows_aligned16: bool,
    sm_count: int | None = None,
) -> KernelLaunch:
    """The launch computing ``x_q[m, k]`` against T2 weights ``[n, ceil(k/16)]`` (pure function).

    Args:
        m, n, k: tokens, output rows, input features.
        group_size: scale group size G (``>= k`` for one group).
        shared_scales: the scales have one row shared by all outputs (``[1, n_groups]``).
        flags: ``FLAG_*`` bits.
        rows_aligned16: the packed weights start on a 16-byte boundary (then 128-bit loads are used
            when each row is a whole number of 16-byte vectors too).
        sm_count: multiprocessors of the device, to size decode blocks (see :func:`rows_per_warp`).
    """
    kw = -(-k // 16)
    ng = -(-k // group_size)
    stride_sn = 0 if shared_scales else ng
    if m <= DECODE_MAX_WIDTH:
        layout = decode_layout(kw, ng, group_size, rows_aligned16)
        if layout is not None:
            vec, u, v, seg, flush_every = layout
            r = rows_per_warp(m, n, sm_count)
            grid = (-(-n // (DECODE_WARPS * r)), 1, 1)
            return KernelLaunch(
                "w2a8_decode.cu",
                f"w2a8_decode_kernel<{m},{r},{vec}>",
                grid,
                (DECODE_THREADS, 1, 1),
                (n, k, kw, ng, u, v, seg, flush_every, stride_sn, flags),
            )
    gw = kw if ng == 1 else group_size // 16
    grid = (-(-n // TILE_N), -(-m // TILE_M), 1)
    return KernelLaunch(
        "w2a8_tiled.cu", "w2a8_tiled_kernel", grid, (TILE_THREADS, 1, 1), (m, n, k, kw, ng, gw, stride_sn, flags)
    )


# --------------------------------------------------------------------------------------------
# Sources


def source_dirs() -> list[Path]:
    """Directories searched for the CUDA sources, in order."""
    dirs = []
    env = os.environ.get(SRC_ENV, "").strip()
    if env:
        dirs.append(Path(env))
    here = Path(__file__).resolve()
    dirs.append(here.parents[2] / "_csrc" / "cuda")  # <site-packages>/bitmtp/_csrc/cuda (wheel)
    dirs.append(here.parents[3] / "csrc" / "cuda")  # <repo>/csrc/cuda (editable install, checkout)
    return dirs


def find_sources() -> Path:
    """The first directory of :func:`source_dirs` holding every file of :data:`SOURCES`."""
    tried = []
    for d in source_dirs():
        if all((d / name).is_file() for name in SOURCES):
            return d
        tried.append(str(d))
    raise BackendUnavailableError(
        f"cuda backend: CUDA sources {', '.join(SOURCES)} not found; tried {', '.join(tried)} "
        f"(set {SRC_ENV} to the directory holding them)"
    )


def load_source(name: str) -> str:
    """The text of ``name`` with the common header pasted in place of its ``#include``.

    Pasting (rather than an NVRTC ``-I``) keeps the whole program in the text CuPy hashes for its
    on-disk kernel cache, so an edited header can never reuse a stale binary.
    """
    d = find_sources()
    text = (d / name).read_text(encoding="utf-8")
    common = (d / "w2a8_common.cuh").read_text(encoding="utf-8")
    if _COMMON_INCLUDE not in text:
        raise BackendUnavailableError(f"cuda backend: {d / name} does not include w2a8_common.cuh")
    return text.replace(_COMMON_INCLUDE, common, 1)


# --------------------------------------------------------------------------------------------
# Argument checks (the front doors in bitmtp.ops validate the user's arguments; these check what a
# raw kernel assumes, so a direct call with a bad tensor raises instead of faulting the GPU)


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _dense(name: str, t: torch.Tensor, align: int) -> None:
    if not t.is_contiguous():
        raise LayoutError(f"{name}: the cuda backend needs a contiguous tensor (got strides {t.stride()})")
    if t.numel() and t.data_ptr() % align:
        raise LayoutError(f"{name}: data must be {align}-byte aligned (address {t.data_ptr():#x})")


def _same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise DeviceError(f"{name}: on {t.device}, but x_q is on {device}; move them to one device")


def _widths(x_q: torch.Tensor, packed: object) -> tuple[int, int]:
    """``(M, N)`` of a call, checking just enough to size its output (prepare_w2a8 checks the rest)."""
    packed = _tensor("packed", packed)
    if x_q.dim() != 2 or packed.dim() != 2:
        raise ShapeError(
            f"x_q/packed: expected 2-D [M, K] and [N, ceil(K/16)] tensors, got shapes "
            f"{tuple(x_q.shape)} and {tuple(packed.shape)}"
        )
    return x_q.shape[0], packed.shape[0]


def _n_groups(k: int, group_size: int) -> int:
    if int(k) < 1 or int(group_size) < 1:
        raise ShapeError(f"k/group_size: must be positive, got k={k}, group_size={group_size}")
    return -(-int(k) // int(group_size))


@dataclass(frozen=True)
class _Prepared:
    launch: KernelLaunch
    pointers: tuple[int, int, int, int, int, int, int]
    keep: tuple[torch.Tensor | None, ...]  # converted inputs: alive until the launch is queued


def prepare_w2a8(
    x_q: torch.Tensor,
    packed: torch.Tensor,
    k: int,
    group_size: int,
    *,
    act_scale: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    acc_out: torch.Tensor | None = None,
    sm_count: int | None = None,
) -> _Prepared:
    """Validate the tensors of one W2A8 call and plan its launch (device-agnostic; no CuPy).

    ``out`` must be float32 or bf16 (the dtypes the kernels store); ``acc_out`` int32
    ``[M, N, n_groups]``. Raises a :class:`~bitmtp.errors.BitMTPError` subclass naming the argument.
    """
    x_q = _tensor("x_q", x_q)
    packed = _tensor("packed", packed)
    if packed.dtype == torch.uint32:
        packed = packed.view(torch.int32)
    if x_q.dtype != torch.int8:
        raise DTypeError(f"x_q: expected int8 quantized activations, got {x_q.dtype}")
    if x_q.dim() != 2 or x_q.shape[0] < 1 or x_q.shape[1] < 1:
        raise ShapeError(f"x_q: expected a non-empty 2-D [M, K] tensor (M >= 1), got shape {tuple(x_q.shape)}")
    if packed.dtype != torch.int32:
        raise DTypeError(f"packed: expected T2 words as int32 (or uint32), got {packed.dtype}")
    if packed.dim() != 2 or packed.shape[0] < 1:
        raise ShapeError(f"packed: expected a non-empty 2-D [N, ceil(K/16)] tensor, got shape {tuple(packed.shape)}")
    m, kx = x_q.shape
    n, kw = packed.shape
    k = int(k)
    if k != kx:
        raise ShapeError(f"x_q: has {kx} columns but k={k}")
    if not 1 <= k <= _MAX_K:
        raise ShapeError(f"k: must be in 1..{_MAX_K}, got {k}")
    if -(-k // 16) != kw:
        raise ShapeError(f"packed: {kw} words per row do not hold K={k} (need {-(-k // 16)})")
    if m > _MAX_GRID_Y * TILE_M or n > _INT32_MAX:
        raise ShapeError(f"x_q/packed: M={m}, N={n} exceed the kernels' grid limits")
    group_size = int(group_size)
    if group_size < 1:
        raise ShapeError(f"group_size: must be positive, got {group_size}")
    ng = -(-k // group_size)
    if ng > 1 and group_size % 16:
        raise ShapeError(f"group_size: must be a multiple of 16 when smaller than K, got {group_size}")
    device = x_q.device
    _same_device(device, packed=packed, act_scale=act_scale, scales=scales, bias=bias, out=out, acc_out=acc_out)
    _dense("x_q", x_q, 1)
    _dense("packed", packed, 4)

    flags = 0
    if k % 16 == 0 and x_q.data_ptr() % 16 == 0:
        flags |= FLAG_X_VEC16
    keep: list[torch.Tensor | None] = []
    scale_ptr = act_ptr = bias_ptr = out_ptr = acc_ptr = 0
    shared_scales = True
    if out is not None:
        out = _tensor("out", out)
        if out.dtype not in DIRECT_OUT_DTYPES:
            raise DTypeError(f"out: the kernels store float32 or bfloat16, got {out.dtype}")
        if tuple(out.shape) != (m, n):
            raise ShapeError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
        _dense("out", out, out.element_size())
        if act_scale is None or scales is None:
            raise ShapeError("act_scale/scales: required when writing out")
        act_scale = _tensor("act_scale", act_scale)
        scales = _tensor("scales", scales)
        if act_scale.dtype != torch.float32:
            raise DTypeError(f"act_scale: expected float32, got {act_scale.dtype}")
        if tuple(act_scale.shape) != (m,):
            raise ShapeError(f"act_scale: expected shape {(m,)}, got {tuple(act_scale.shape)}")
        _dense("act_scale", act_scale, 4)
        if scales.dtype != torch.float32:
            raise DTypeError(f"scales: expected float32, got {scales.dtype}")
        if scales.dim() != 2 or scales.shape[0] not in (1, n) or scales.shape[1] != ng:
            raise ShapeError(
                f"scales: expected shape (1, {ng}) or ({n}, {ng}) for K={k}, group_size={group_size}; "
                f"got {tuple(scales.shape)}"
            )
        _dense("scales", scales, 4)
        shared_scales = scales.shape[0] == 1
        if bias is not None:
            bias = _tensor("bias", bias)
            if not bias.is_floating_point():
                raise DTypeError(f"bias: expected a float tensor, got {bias.dtype}")
            if tuple(bias.shape) != (n,):
                raise ShapeError(f"bias: expected shape {(n,)}, got {tuple(bias.shape)}")
            if bias.dtype != torch.float32 or not bias.is_contiguous():
                bias = bias.to(torch.float32).contiguous()  # the kernels read float32
                keep.append(bias)
            _dense("bias", bias, 4)
            flags |= FLAG_HAS_BIAS
            bias_ptr = bias.data_ptr()
        flags |= FLAG_WRITE_OUT | (FLAG_OUT_BF16 if out.dtype == torch.bfloat16 else 0)
        scale_ptr, act_ptr, out_ptr = scales.data_ptr(), act_scale.data_ptr(), out.data_ptr()
    if acc_out is not None:
        acc_out = _tensor("acc_out", acc_out)
        if acc_out.dtype != torch.int32 or tuple(acc_out.shape) != (m, n, ng):
            raise ShapeError(f"out: expected an int32 tensor of shape {(m, n, ng)}, got {acc_out.dtype} "
                             f"{tuple(acc_out.shape)}")
        _dense("out", acc_out, 4)
        flags |= FLAG_WRITE_ACC
        acc_ptr = acc_out.data_ptr()
    if not flags & (FLAG_WRITE_OUT | FLAG_WRITE_ACC):
        raise ShapeError("out: nothing to write (give out and/or acc_out)")

    launch = plan_w2a8(
        m,
        n,
        k,
        group_size,
        shared_scales=shared_scales,
        flags=flags,
        rows_aligned16=packed.data_ptr() % 16 == 0,
        sm_count=sm_count,
    )
    pointers = (x_q.data_ptr(), act_ptr, packed.data_ptr(), scale_ptr, bias_ptr, out_ptr, acc_ptr)
    return _Prepared(launch, pointers, tuple(keep))


# --------------------------------------------------------------------------------------------
# The backend


class _StreamRef:
    """A raw stream handle in the CUDA stream protocol (``cupy.cuda.Stream.from_external``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


class CudaBackend:
    """W2A8 ops on CUDA tensors through the kernels of ``csrc/cuda`` (see the module docstring)."""

    name = "cuda"

    def __init__(self) -> None:
        self._cupy = None
        self._cupy_error: str | None = None
        self._available: dict[torch.device, tuple[bool, str]] = {}
        self._functions: dict[tuple[int, str, str], object] = {}
        self._streams: dict[tuple[int, int], object] = {}
        self._sm_counts: dict[torch.device, int] = {}
        self._lock = threading.Lock()

    # -- availability ------------------------------------------------------------------------

    def _import_cupy(self):
        if self._cupy is None and self._cupy_error is None:
            try:
                import cupy
            except ImportError as exc:
                self._cupy_error = f"cupy not installed: {CUPY_HINT} ({exc})"
            except Exception as exc:  # a broken CUDA install surfaces here: report it, do not crash
                self._cupy_error = f"cupy failed to import: {type(exc).__name__}: {exc}"
            else:
                self._cupy = cupy
        return self._cupy

    def availability(self, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"the cuda backend runs on CUDA tensors, not {device.type!r}"
        cached = self._available.get(device)
        if cached is None:
            cached = self._check(device)
            self._available[device] = cached
        return cached

    def _check(self, device: torch.device) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "no CUDA device visible to torch"
        if getattr(torch.version, "hip", None):
            return False, "torch is a ROCm build; the cuda backend needs NVIDIA CUDA"
        cp = self._import_cupy()
        if cp is None:
            return False, self._cupy_error or "cupy not available"
        try:
            find_sources()
        except BackendUnavailableError as exc:
            return False, str(exc)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return False, f"no CUDA device {index} (torch sees {torch.cuda.device_count()})"
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (6, 1):
            return False, f"sm_{major}{minor} lacks __dp4a (needs compute capability 6.1 or newer)"
        try:  # build (or load from CuPy's disk cache) the M = 1 kernel: proves NVRTC works here
            self._function(index, "w2a8_decode.cu", PROBE_KERNEL)
        except BackendUnavailableError as exc:
            return False, str(exc)
        return True, f"CUDA kernels (CuPy {cp.__version__}, NVRTC) on sm_{major}{minor}"

    def _require(self, device: torch.device) -> int:
        """Raise unless the backend runs on ``device``; return its multiprocessor count."""
        ok, why = self.availability(device)
        if not ok:
            raise BackendUnavailableError(f"backend 'cuda' cannot run on {device}: {why}")
        sms = self._sm_counts.get(device)
        if sms is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self._sm_counts[device] = sms
        return sms

    # -- launching ---------------------------------------------------------------------------

    def _function(self, index: int, source: str, name: str):
        key = (index, source, name)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    cp = self._cupy
                    code = load_source(source)
                    try:
                        with cp.cuda.Device(index):
                            module = cp.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=[name])
                            fn = module.get_function(name)  # compiles (or loads from CuPy's disk cache)
                    except Exception as exc:  # NVRTC missing / too old for this GPU, or a compile error
                        reason = f"building {name} from {source} through CuPy/NVRTC failed: {type(exc).__name__}: {exc}"
                        self._available[torch.device("cuda", index)] = (False, reason)
                        raise BackendUnavailableError(f"cuda backend: {reason}") from exc
                    self._functions[key] = fn
        return fn

    def _stream(self, index: int):
        """CuPy's view of torch's current stream on device ``index`` (what graph capture records)."""
        ptr = torch.cuda.current_stream(index).cuda_stream
        key = (index, ptr)
        stream = self._streams.get(key)
        if stream is None:
            cp = self._cupy
            from_external = getattr(cp.cuda.Stream, "from_external", None)
            if from_external is not None:  # CuPy >= 14
                stream = from_external(_StreamRef(ptr))
            else:
                stream = cp.cuda.ExternalStream(ptr, index)
            if len(self._streams) > 64:  # capture streams come and go
                self._streams.clear()
            self._streams[key] = stream
        return stream

    def _launch(self, prepared: _Prepared, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        launch = prepared.launch
        fn = self._function(index, launch.source, launch.name)
        args = tuple(np.uint64(p) for p in prepared.pointers) + tuple(np.int32(v) for v in launch.scalars)
        cp = self._cupy
        with cp.cuda.Device(index), self._stream(index):
            fn(launch.grid, launch.block, args)

    # -- ops ---------------------------------------------------------------------------------

    def act_quant(self, x):
        """Per-token int8 quantization in one launch: the Triton kernel (``triton_kernels.layers.quantize_rows``;
        the cuda extras install Triton), else the torch reference's eight ops."""
        try:
            from bitmtp.triton_kernels.layers import quantize_rows
        except ImportError:  # triton missing: the reference (same bits)
            from bitmtp.ops import reference

            return reference.act_quant_reference(x)
        lead, k = x.shape[:-1], x.shape[-1]
        q, s = quantize_rows(x.reshape(-1, k).contiguous())
        return q.reshape(*lead, k), s.reshape(lead)

    def w2a8_accumulate(self, x_q, packed, k, group_size, out=None):
        """Exact per-group accumulators ``int32[M, N, n_groups]`` (see bitmtp.ops.w2a8_accumulate)."""
        x_q = _tensor("x_q", x_q)
        sms = self._require(x_q.device)
        m, n = _widths(x_q, packed)
        ng = _n_groups(k, group_size)
        if out is None:
            out = torch.empty((m, n, ng), dtype=torch.int32, device=x_q.device)
        prepared = prepare_w2a8(x_q, packed, k, group_size, acc_out=out, sm_count=sms)
        self._launch(prepared, x_q.device)
        return out

    def w2a8_linear_q(self, x_q, act_scale, packed, scales, k, group_size, bias, out_dtype, out=None):
        """``y[M, N] = Σ_g acc_g · scale_g / act_scale (+ bias)`` in ``out_dtype``.

        float32 and bfloat16 are stored by the kernel (bf16 rounded to nearest-even); other float
        dtypes go through a float32 buffer.
        """
        x_q = _tensor("x_q", x_q)
        sms = self._require(x_q.device)
        if out_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise DTypeError(f"out_dtype: expected a float dtype, got {out_dtype}")
        m, n = _widths(x_q, packed)
        if out is not None:
            out = _tensor("out", out)
            if tuple(out.shape) != (m, n):
                raise ShapeError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
            if not out.is_floating_point():
                raise DTypeError(f"out: expected a float tensor, got {out.dtype}")
            if not out.is_contiguous():
                raise LayoutError(f"out: the cuda backend writes contiguous outputs (got strides {out.stride()})")
        target = out
        if target is None or target.dtype not in DIRECT_OUT_DTYPES:
            dtype = out_dtype if out is None and out_dtype in DIRECT_OUT_DTYPES else torch.float32
            target = torch.empty((m, n), dtype=dtype, device=x_q.device)
        prepared = prepare_w2a8(
            x_q, packed, k, group_size, act_scale=act_scale, scales=scales, bias=bias, out=target, sm_count=sms
        )
        self._launch(prepared, x_q.device)
        if out is not None:
            if target is not out:
                out.copy_(target)
            return out
        return target if target.dtype == out_dtype else target.to(out_dtype)


__all__ = [
    "CudaBackend",
    "KernelLaunch",
    "SRC_ENV",
    "decode_layout",
    "find_sources",
    "load_source",
    "plan_w2a8",
    "prepare_w2a8",
    "rows_per_warp",
    "source_dirs",
]
