"""The ``cpu`` backend: the native W2A8 kernels of ``csrc/cpu`` (extension ``bitmtp._cpu_w2a8``).

One call streams each packed weight row once and applies it to all M ≤ 16 tokens (larger M runs
in chunks of 16): the single-pass multi-token GEMV that decode steps and CPU-offloaded layers need.
The ISA path (AVX-512 VNNI, AVX2, scalar) is picked from CPUID; force one with
``BITMTP_CPU_ISA=scalar|avx2|avx512_vnni`` or :func:`forced_isa` (tests run every path).
Threads follow ``torch.get_num_threads()`` (``bitmtp.ops.threads.kernel_threads``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bitmtp.errors import BackendUnavailableError, BitMTPError, LayoutError, ShapeError
from bitmtp.formats.ggml_blocks import dequantize
from bitmtp.ops import reference
from bitmtp.ops.registry import NativeKernelsMissing
from bitmtp.ops.threads import kernel_threads

ISA_NAMES = {"scalar": 0, "avx2": 1, "avx512_vnni": 2}
ISA_ENV = "BITMTP_CPU_ISA"
_forced: list[str] = []


#: what running without the extension costs, measured on SmolLM2-135M-Instruct Q4_1, greedy AR decoding of
#: 24 tokens, one thread, torch 2.13 CPU, AMD EPYC: 0.48-0.58 s of CPU time on the native kernels, 2.2-2.4 s
#: with BITMTP_BACKEND=torch and 2.5-2.8 s with the extension made unimportable (same tokens)
MISSING_COST = ("about 4.5x slower (SmolLM2-135M greedy decoding: ~100 ms of CPU time per token instead of ~22 ms; "
                "same tokens)")


def _load_extension():
    try:
        ext = importlib.import_module("bitmtp._cpu_w2a8")
    except ImportError as exc:
        # not built (no compiler or pybind11 at install time, or a sdist without csrc headers) or built for
        # another Python / torch ABI: either way the install "worked", so say loudly what is lost
        built = "is not installed" if isinstance(exc, ModuleNotFoundError) else "does not load"
        raise NativeKernelsMissing(
            f"native CPU kernels missing: the extension bitmtp._cpu_w2a8 {built} ({exc}). bitmtp runs on its "
            f"pure-torch paths instead, {MISSING_COST}. To build them, install a C++ compiler "
            "(Debian/Ubuntu: apt install build-essential) and reinstall bitmtp from source (pip install "
            "--force-reinstall --no-binary bitmtp bitmtp; in a checkout: pip install -e . "
            "--no-build-isolation); BITMTP_REQUIRE_CPU_EXT=1 makes a build that skips them fail instead."
        ) from exc
    return ext


@contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """Run the ``cpu`` backend on one ISA path inside the block (raises if the CPU lacks it)."""
    if name not in ISA_NAMES:
        raise BitMTPError(f"isa: expected one of {', '.join(ISA_NAMES)}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def supported_isas() -> list[str]:
    """ISA paths this CPU can run, slowest first."""
    ext = _load_extension()
    return [name for name, code in ISA_NAMES.items() if code <= ext.best_isa()]


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._ext = _load_extension()
        self.features = dict(self._ext.cpu_features())
        # (made once: the fused layers ask for it every step)
        self._ready = (f"native kernels, {self.features['best']} path, "
                       f"threads: {self.features.get('threading', 'bitmtp pool')}")

    def availability(self, device: torch.device) -> tuple[bool, str]:
        if device.type != "cpu":
            return False, f"native CPU kernels run on CPU tensors, not {device.type}"
        return True, self._ready

    def _isa(self) -> int:
        name = _forced[-1] if _forced else os.environ.get(ISA_ENV, "").strip() or None
        if name is None:
            return -1
        if name not in ISA_NAMES:
            raise BitMTPError(f"{ISA_ENV}: expected one of {', '.join(ISA_NAMES)}, got {name!r}")
        if ISA_NAMES[name] > self._ext.best_isa():
            raise BackendUnavailableError(f"isa: this CPU cannot run the {name} path (best: {self.features['best']})")
        return ISA_NAMES[name]

    @staticmethod
    def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        if t.device.type != "cpu":
            raise BitMTPError(f"{name}: the cpu backend needs CPU tensors, got {t.device}")
        if t.dtype != dtype:
            raise BitMTPError(f"{name}: expected {dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise LayoutError(f"{name}: must be contiguous")
        if t.data_ptr() % t.element_size():
            raise LayoutError(f"{name}: data pointer {t.data_ptr():#x} is not aligned to {t.element_size()} bytes")

    def _run(self, x_q, packed, k, group_size, scales=None, act_scale=None, bias=None, y=None, acc=None):
        m = x_q.shape[0]
        if m < 1:
            raise ShapeError("x_q: M = 0 rows; W2A8 needs M >= 1 tokens")
        n, kw = packed.shape
        self._check("x_q", x_q, torch.int8)
        self._check("weight", packed, torch.int32)
        ng = -(-k // group_size)
        for name, t, dt in (("scales", scales, torch.float32), ("act_scale", act_scale, torch.float32),
                            ("bias", bias, torch.float32), ("out", y, torch.float32), ("out", acc, torch.int32)):
            if t is not None:
                self._check(name, t, dt)
        try:
            self._ext.run(
                x_q.data_ptr(), m, k, packed.data_ptr(), n, kw,
                scales.data_ptr() if scales is not None else 0,
                scales.shape[0] if scales is not None else 1, ng, group_size,
                act_scale.data_ptr() if act_scale is not None else 0,
                bias.data_ptr() if bias is not None else 0,
                y.data_ptr() if y is not None else 0,
                acc.data_ptr() if acc is not None else 0,
                self._isa(), kernel_threads(),
            )
        except ValueError as exc:  # the extension's own argument checks
            raise ShapeError(str(exc)) from exc

    def act_quant(self, x):
        """Per-token int8 quantization in the extension, on the calling thread: the reference's bits
        (widened to float32 first, as the reference does), without torch ops."""
        lead, k = x.shape[:-1], x.shape[-1]
        xf = x.reshape(-1, k).to(torch.float32).contiguous()
        m = xf.shape[0]
        x_q = torch.empty((m, k), dtype=torch.int8)
        s = torch.empty((m,), dtype=torch.float32)
        if m:
            self._ext.act_quant(xf.data_ptr(), m, k, x_q.data_ptr(), s.data_ptr())
        return x_q.reshape(*lead, k), s.reshape(lead)

    def w2a8_linear(self, x2, packed, scales, k, group_size, bias, out_dtype):
        """``w2a8_linear`` on ``x2[M, K]`` in ONE extension call: the activations are quantized inside it
        (act_quant's bits), then the kernel runs — no torch op between them."""
        xf = x2.to(torch.float32).contiguous()
        m = xf.shape[0]
        if m < 1:
            raise ShapeError("x: M = 0 rows; W2A8 needs M >= 1 tokens")
        n, kw = packed.shape
        self._check("weight", packed, torch.int32)
        self._check("scales", scales, torch.float32)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        y = torch.empty((m, n), dtype=torch.float32)
        try:
            self._ext.linear_f32(xf.data_ptr(), m, k, packed.data_ptr(), n, kw, scales.data_ptr(), scales.shape[0],
                                 -(-k // group_size), group_size, b.data_ptr() if b is not None else 0, y.data_ptr(),
                                 self._isa(), kernel_threads())
        except ValueError as exc:  # the extension's own argument checks
            raise ShapeError(str(exc)) from exc
        return y if out_dtype == torch.float32 else y.to(out_dtype)

    def w2a8_accumulate(self, x_q, packed, k, group_size, out=None):
        if out is None:
            out = torch.empty((x_q.shape[0], packed.shape[0], -(-k // group_size)), dtype=torch.int32)
        self._run(x_q, packed, k, group_size, acc=out)
        return out

    def w2a8_linear_q(self, x_q, act_scale, packed, scales, k, group_size, bias, out_dtype, out=None):
        # The kernel writes float32: straight into `out` when it is float32, else via a buffer.
        direct = out is not None and out.dtype == torch.float32
        y = out if direct else torch.empty((x_q.shape[0], packed.shape[0]), dtype=torch.float32)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        self._run(x_q, packed, k, group_size, scales=scales, act_scale=act_scale, bias=b, y=y)
        if out is None:
            return y if out_dtype == torch.float32 else y.to(out_dtype)
        if not direct:
            out.copy_(y)
        return out

    def attention(self, q, k, v, mask, scale):
        """Row-deterministic attention (csrc/cpu/attention.cpp): a row's output depends only on its
        own query and the KV rows its mask allows, never on the step's width or segment length. A row
        that sees no KV row outputs zeros; M = 0 an empty output (the reference's definition)."""
        half = k.dtype == torch.float16 and v.dtype == torch.float16
        if q.dtype != torch.float32 or not (half or (k.dtype == torch.float32 and v.dtype == torch.float32)):
            # the kernel takes float32 q with float32 or float16 K/V
            return reference.attention_reference(q, k, v, mask, scale)
        m, h, d = q.shape
        kvh, s_rows, _ = k.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        # the edges the kernel refuses (it requires M, H, D, L >= 1), defined as on every backend
        # (reference.attention_reference): no query rows, heads or head dims -> the empty output; no KV
        # rows in the segment -> every row fully masked -> zeros. A fully masked row inside a segment is
        # zeros in the kernel itself (attention_body.inc, merge_pair)
        if out.numel() == 0:
            return out
        if mask.shape[1] == 0:
            return out.zero_()
        mask_u8 = mask.contiguous().view(torch.uint8)
        self._check("k", k, k.dtype)
        self._check("v", v, v.dtype)
        self._ext.attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask_u8.data_ptr(), out.data_ptr(),
                            m, h, kvh, d, s_rows, mask.shape[1], float(scale), kernel_threads(), self._isa(),
                            half)
        return out

    #: ``argmax_prob`` may write into ``out=`` (``ops.choose`` copies whatever it returns instead)
    argmax_prob_out = True

    def argmax_prob(self, logits, out=None):
        """Each row's first argmax and softmax probability on the extension's thread team
        (csrc/cpu/argmax_prob.h): torch's own softmax/max at a large vocabulary run as OpenMP regions whose
        spinning workers slowed the next step's kernels (a SmolLM2 width-1 step 8.4 -> 11.6 ms). Other
        dtypes go to the torch reference. ``out``: contiguous ``(tok, prob)`` buffers the kernel writes
        into (checked by ``ops.choose``); strided ones are ignored (new tensors are returned)."""
        if logits.dtype != torch.float32:
            return reference.argmax_prob_reference(logits)
        if not logits.is_contiguous():
            logits = logits.contiguous()
        m, v = logits.shape
        if out is not None and out[0].is_contiguous() and out[1].is_contiguous():
            tok, prob = out
        else:
            tok = torch.empty(m, dtype=torch.long)
            prob = torch.empty(m, dtype=torch.float32)
        if m:
            self._ext.argmax_prob(logits.data_ptr(), m, v, tok.data_ptr(), prob.data_ptr(), kernel_threads(),
                                  self._isa())
        return tok, prob

    def norm_head_argmax(self, x, norm_weight, eps, weight, blocks, bias, out, logits_out):
        """:func:`bitmtp.ops.head.norm_head_argmax` in one native call — :meth:`rms_norm`, :meth:`dense_linear` (or
        :meth:`dense_linear_blocks`) and :meth:`argmax_prob` one after the other, so their bits — or None where
        one of them would not run natively here (another dtype, strided tensors, gradients): the caller then
        runs the three ops. ``out`` / ``logits_out``: contiguous buffers to write into, else new tensors."""
        f32 = torch.float32
        if x.dim() != 2 or x.dtype != f32 or not x.is_contiguous():
            return None
        if torch.is_grad_enabled() and (x.requires_grad or norm_weight.requires_grad):
            return None
        operands = self.tail_operands(norm_weight, weight, blocks, bias)
        if operands is None:
            return None
        w_ptr, n, bias_ptr, fmt = operands
        m, k = x.shape
        if out is not None and out[0].is_contiguous() and out[1].is_contiguous():
            tok, prob = out
        else:
            tok, prob = torch.empty(m, dtype=torch.long), torch.empty(m, dtype=f32)
        logits = logits_out if logits_out is not None and logits_out.is_contiguous() else torch.empty((m, n), dtype=f32)
        normed = torch.empty_like(x)
        self._ext.norm_head_argmax(x.data_ptr(), m, k, norm_weight.data_ptr(), float(eps), normed.data_ptr(), w_ptr,
                                   n, bias_ptr, fmt, logits.data_ptr(), tok.data_ptr(), prob.data_ptr(), self._isa(),
                                   kernel_threads())
        return tok, prob, logits

    def tail_operands(self, norm_weight, weight, blocks, bias) -> tuple[int, int, int, int] | None:
        """``(head pointer, N, bias pointer or 0, format code)`` of a step's tail whose three ops run natively here
        (float32 contiguous norm weight and bias; GGML blocks — with no float weight other than float32 beside them —
        or a float32 contiguous weight), else None (:meth:`norm_head_argmax`, the fused layers' tail)."""
        f32 = torch.float32
        if norm_weight.dtype != f32 or not norm_weight.is_contiguous():
            return None
        if bias is not None and (bias.dtype != f32 or not bias.is_contiguous()):
            return None
        if blocks is not None:
            if weight is not None and weight.dtype != f32:  # dense_linear_blocks takes the reference then
                return None
            w_ptr, n, fmt = blocks.data.data_ptr(), blocks.shape[0], blocks.code
        elif weight is not None and weight.dtype == f32 and weight.is_contiguous():
            w_ptr, n, fmt = weight.data_ptr(), weight.shape[0], 0
        else:
            return None
        return w_ptr, n, 0 if bias is None else bias.data_ptr(), fmt

    def rms_norm(self, x, weight, eps):
        """The fused layers' RMSNorm (csrc/cpu/layers.cpp) on float32 rows that need no gradient, bit-exact with
        the reference (which runs everything else)."""
        f32 = torch.float32
        if x.dtype != f32 or weight.dtype != f32 or (torch.is_grad_enabled() and (x.requires_grad or
                                                                                  weight.requires_grad)):
            return reference.rms_norm_reference(x, weight, eps)
        if not x.is_contiguous():
            x = x.contiguous()
        if not weight.is_contiguous():
            weight = weight.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        rows = x.numel() // n if n else 0
        if rows:
            self._ext.rms_norm(x.data_ptr(), rows, n, weight.data_ptr(), eps, y.data_ptr())
        return y

    def dense_linear(self, x, weight, bias=None):
        """float32 multi-token GEMV (csrc/cpu/dense_*.cpp): each weight row streamed once for all
        tokens, a fixed summation order per (row, token) — independent of the number of tokens.
        Other dtypes go to the torch reference."""
        f32 = torch.float32
        if x.dtype != f32 or weight.dtype != f32 or (bias is not None and bias.dtype != f32):
            return reference.dense_linear_reference(x, weight, bias)
        self._check("weight", weight, f32)
        return self._dense(x, weight.data_ptr(), weight.shape[0], bias, 0)

    def dense_linear_blocks(self, x, weight, blocks, bias=None):
        """The same GEMV reading the weight from its GGML blocks (``bitmtp.formats.ggml_blocks``):
        each block is decoded with gguf-py's float32 operations, so the result is bit-identical to
        :meth:`dense_linear` on ``weight`` while a Q4_1 row is 6.4x fewer bytes. ``weight`` may be None (the
        blocks alone); the torch reference that other dtypes fall back to then dequantizes them for the call."""
        f32 = torch.float32
        if x.dtype != f32 or (weight is not None and weight.dtype != f32) or (bias is not None and bias.dtype != f32):
            return reference.dense_linear_reference(x, dequantize(blocks) if weight is None else weight, bias)
        return self._dense(x, blocks.data.data_ptr(), blocks.shape[0], bias, blocks.code)

    def _dense(self, x, w_ptr: int, n: int, bias, fmt: int):
        # no torch call a step's [M, K] contiguous rows do not need (each 10-30 µs with cold caches, bench/glue.py)
        lead = x.shape[:-1]
        k = x.shape[-1]
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
        y = torch.empty((x2.shape[0], n), dtype=torch.float32)
        b = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        self._ext.dense(x2.data_ptr(), x2.shape[0], k, w_ptr, n, b.data_ptr() if b is not None else 0,
                        y.data_ptr(), self._isa(), kernel_threads(), fmt)
        return y if len(lead) == 1 else y.reshape(*lead, n)
