"""The decoder's ops as WGSL dispatches on :class:`DeviceTensor` s (nothing is read back unless asked).

Each method records one or a few dispatches into the runner's open command encoder and returns device
tensors, so a layer (or a whole step) is one submission. The pure-torch references these are tested
against live in ``bitmtp.ops.reference`` and ``bitmtp.model.layers``; the rules are in
``tests/wgsl_fallback/test_<shader>.py`` (integer accumulators exact, float ops within 1e-5 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bitmtp.errors import BitMTPError, ShapeError
from bitmtp.wgsl_fallback import dense_rows, w2a8_rows
from bitmtp.wgsl_fallback.runner import DeviceTensor, Runner

MAX_TOKENS = 16  # register tile of the linear shaders: wider steps run in slices of 16 rows
MAX_SEGMENT = 4096  # attention keeps a row's scores in workgroup memory (attention.wgsl MAX_L)
WORDS_PER_GROUP = 16  # T2: 16 weights per 32-bit word
DENSE_ROWS_PER_GROUP = 4  # dense.wgsl ROWS


@dataclass
class TernaryWeight:
    """A T2 ternary matrix on the device: words ``u32[N, Kw]`` (row-chunked when larger than one
    binding) and float32 scales ``[1 | N, n_groups]``."""

    words: DeviceTensor
    scales: DeviceTensor
    n: int
    k: int
    group_size: int

    @property
    def kw(self) -> int:
        return self.words.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    @classmethod
    def upload(cls, runner: Runner, packed: np.ndarray, scales: np.ndarray, k: int, group_size: int | None = None,
               *, chunk_rows: int | None = None) -> TernaryWeight:
        packed = np.ascontiguousarray(packed).view(np.uint32)
        scales = np.ascontiguousarray(scales, dtype=np.float32)
        n, kw = packed.shape
        if kw * WORDS_PER_GROUP < k or (kw - 1) * WORDS_PER_GROUP >= k:
            raise ShapeError(f"packed: {kw} words per row do not hold K={k}")
        if scales.ndim != 2 or scales.shape[0] not in (1, n):
            raise ShapeError(f"scales: expected [1 or {n}, n_groups], got {scales.shape}")
        group = group_size or (k if scales.shape[1] == 1 else k // scales.shape[1])
        if scales.shape[1] > 1 and (group % WORDS_PER_GROUP or -(-k // group) != scales.shape[1]):
            raise ShapeError(f"group_size {group}: the wgpu kernels need scale groups that are whole T2 words "
                             f"(multiples of 16) and {scales.shape[1]} groups covering K={k}")
        return cls(runner.upload(packed, "u32", chunk_rows=chunk_rows), runner.upload(scales, "f32"), n, k, group)


@dataclass
class DenseWeight:
    """A dense matrix on the device: float32 ``[N, K]``, or bf16 / f16 pairs packed in u32 words
    ``[N, ceil(K/2)]`` (half the memory; the shaders widen them to float32 exactly)."""

    data: DeviceTensor
    n: int
    k: int
    kind: str  # "f32" | "bf16" | "f16"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def defines(self) -> frozenset[str]:
        return frozenset() if self.kind == "f32" else frozenset({self.kind.upper()})

    @classmethod
    def upload(cls, runner: Runner, weight, *, chunk_rows: int | None = None) -> DenseWeight:
        """From a torch tensor (float32 / bfloat16 / float16 kept as they are; other floats as float32)."""
        import torch

        w = weight.detach().cpu().contiguous()
        n, k = w.shape
        if w.dtype in (torch.bfloat16, torch.float16):
            kind = "bf16" if w.dtype == torch.bfloat16 else "f16"
            bits = w.view(torch.int16).numpy().view(np.uint16)
            if k % 2:
                bits = np.concatenate([bits, np.zeros((n, 1), np.uint16)], axis=1)
            words = np.ascontiguousarray(bits).view(np.uint32)  # element 2j in the low half (little-endian)
            return cls(runner.upload(words, "u32", chunk_rows=chunk_rows), n, k, kind)
        return cls(runner.upload(w.to(torch.float32).numpy(), "f32", chunk_rows=chunk_rows), n, k, "f32")


def _dense_parts(w) -> tuple[DeviceTensor, int, int, str, frozenset[str]]:
    if isinstance(w, DenseWeight):
        return w.data, w.n, w.k, w.kind, w.defines
    return w, w.shape[0], w.shape[1], "f32", frozenset()


class Ops:
    """WGSL implementations of the decoder's ops on one :class:`Runner`."""

    def __init__(self, runner: Runner):
        self.r = runner
        self._zero = runner.upload(np.zeros(4, np.float32))

    # ---- W2A8 ------------------------------------------------------------------------------------------

    def act_quant(self, x: DeviceTensor, group_size: int) -> tuple[DeviceTensor, DeviceTensor, DeviceTensor]:
        """``(x_q packed u32[Kp/4, M] (token-minor), s f32[M], xsum i32[M, n_groups])`` of ``x f32[M, K]``."""
        m, k = x.shape
        k4 = -(-k // WORDS_PER_GROUP) * 4
        n_groups = -(-k // group_size)
        xq = self.r.empty((k4, m), "u32", min_bytes=self._rows_xq_bytes(m, k4 // 4))
        s = self.r.empty((m,), "f32")
        xsum = self.r.empty((m, n_groups), "i32")
        params = self.r.uniform("8I", m, k, k4, group_size, n_groups, 0, 0, 0)
        self.r.dispatch("act_quant", "main", {0: x, 1: xq, 2: s, 3: xsum, 4: params}, (m, 1, 1))
        return xq, s, xsum

    def _rows_windows(self, m: int, kw: int) -> int:
        """Activation windows the rows W2A8 shader binds for ``m`` tokens over ``kw`` T2 words, or 0 where
        that shader is not used (a GPU adapter, or activations wider than its windows)."""
        if self.r.w2a8_kernel != "rows" or m > MAX_TOKENS:
            return 0
        n = w2a8_rows.windows_needed(m, kw)
        return n if n <= w2a8_rows.MAX_WINDOWS else 0

    def _rows_xq_bytes(self, m: int, kw: int) -> int:
        """Bytes the x_q buffer needs so that every activation window the rows shader binds lies inside it."""
        n = self._rows_windows(m, kw)
        return (n - 1) * w2a8_rows.window_words(m) * 16 * m + w2a8_rows.WINDOW_BYTES if n else 0

    def _w2a8(self, entry: str, xq, s, xsum, w: TernaryWeight, bias, out) -> None:
        m = xq.shape[1]
        if m > MAX_TOKENS:
            raise ShapeError(f"w2a8: at most {MAX_TOKENS} tokens per dispatch, got {m}")
        gw = w.group_size // WORDS_PER_GROUP if w.n_groups > 1 else w.kw
        windows = self._rows_windows(m, w.kw)
        if windows and len(xq.chunks) == 1 and xq.buffer.size >= self._rows_xq_bytes(m, w.kw):
            self._w2a8_rows(entry, xq, s, xsum, w, bias, out, gw, windows)
            return
        for i, chunk in enumerate(w.words.chunks):
            start = i * w.words.rows_per_chunk
            rows = min(w.words.rows_per_chunk, w.n - start)
            grid = self.r.grid(rows)
            params = self.r.uniform("12I", m, rows, w.kw, w.kw * 4, w.n_groups, gw, w.scales.shape[0],
                                    int(bias is not None), w.n, start, grid[0], 0)
            b = {0: xq, 1: xsum, 2: chunk, 8: params}
            if entry == "linear":
                b.update({3: s, 4: w.scales, 5: bias if bias is not None else self._zero, 6: out})
            else:
                b[7] = out
            self.r.dispatch("w2a8", entry, b, grid, constants=(("TOKENS", m),))

    def _w2a8_rows(self, entry: str, xq, s, xsum, w: TernaryWeight, bias, out, gw: int, windows: int) -> None:
        """``_w2a8`` through the rows shader (``w2a8_rows.py``): 64 rows per workgroup, x_q bound as
        ``windows`` uniform windows of its buffer."""
        m = xq.shape[1]
        stride = w2a8_rows.window_words(m) * 16 * m  # bytes of x_q per window
        x_bind = {w2a8_rows.WINDOW_BINDINGS[c]: (xq, c * stride, w2a8_rows.WINDOW_BYTES) for c in range(windows)}
        rows_per_lane = w2a8_rows.ROWS
        defines = frozenset({f"TOKENS={m}", f"WINDOWS={windows}", f"ROWS={rows_per_lane}",
                             f"ARITH={w2a8_rows.ARITH}", f"SHARE={w2a8_rows.share_size(self.r.subgroup_size)}"})
        for i, chunk in enumerate(w.words.chunks):
            start = i * w.words.rows_per_chunk
            rows = min(w.words.rows_per_chunk, w.n - start)
            grid = self.r.grid(-(-rows // (w2a8_rows.WG * rows_per_lane)))
            params = self.r.uniform("12I", m, rows, w.kw, w.kw * 4, w.n_groups, gw, w.scales.shape[0],
                                    int(bias is not None), w.n, start, grid[0], 0)
            b = {1: xsum, 2: chunk, 8: params, **x_bind}
            if entry == "linear":
                b.update({3: s, 4: w.scales, 5: bias if bias is not None else self._zero, 6: out})
            else:
                b[7] = out
            self.r.dispatch("w2a8_rows", entry, b, grid, defines)

    def w2a8(self, xq, s, xsum, w: TernaryWeight, bias: DeviceTensor | None = None,
             out: DeviceTensor | None = None) -> DeviceTensor:
        """``y f32[M, N]`` from quantized activations; ``out`` may be a preallocated buffer."""
        out = out or self.r.empty((xq.shape[1], w.n), "f32")
        self._w2a8("linear", xq, s, xsum, w, bias, out)
        return out

    def w2a8_accumulate(self, xq, xsum, w: TernaryWeight) -> DeviceTensor:
        """The exact integer accumulators ``i32[M, N, n_groups]`` (Σ c·x_q − Σ x_q per group)."""
        out = self.r.empty((xq.shape[1], w.n, w.n_groups), "i32")
        self._w2a8("accumulate", xq, None, xsum, w, None, out)
        return out

    def ternary_linear(self, x: DeviceTensor, w: TernaryWeight, bias: DeviceTensor | None = None) -> DeviceTensor:
        """Quantize ``x f32[M, K]`` per token, then W2A8; rows beyond 16 run as further 16-row tiles."""
        if x.shape[0] > MAX_TOKENS:
            return self._tiled(x, lambda part: self.ternary_linear(part, w, bias), w.n)
        xq, s, xsum = self.act_quant(x, w.group_size)
        return self.w2a8(xq, s, xsum, w, bias)

    # ---- dense -----------------------------------------------------------------------------------------

    def dense(self, x: DeviceTensor, w: DeviceTensor | DenseWeight, bias: DeviceTensor | None = None) -> DeviceTensor:
        """``y = x @ w.T (+ bias)`` in float32; ``w`` (float32, or a bf16/f16 :class:`DenseWeight`) may be
        row-chunked (a large LM head)."""
        m, k = x.shape
        data, n, wk, _, defines = _dense_parts(w)
        if wk != k:
            raise ShapeError(f"dense: x has K={k}, weight has shape {(n, wk)}")
        if m > MAX_TOKENS:
            return self._tiled(x, lambda part: self.dense(part, w, bias), n)
        kind = w.kind if isinstance(w, DenseWeight) else "f32"
        if self.r.dense_kernel == "rows" and dense_rows.usable(m, k, kind) and len(x.chunks) == 1:
            return self._dense_rows(x, data, n, k, kind, bias)
        out = self.r.empty((m, n), "f32")
        k2 = data.shape[1]
        for i, chunk in enumerate(data.chunks):
            start = i * data.rows_per_chunk
            rows = min(data.rows_per_chunk, n - start)
            grid = self.r.grid(-(-rows // DENSE_ROWS_PER_GROUP))
            params = self.r.uniform("8I", m, rows, k, int(bias is not None), n, start, grid[0], k2)
            self.r.dispatch("dense", "main", {0: x, 1: chunk, 2: bias if bias is not None else self._zero, 3: out,
                                              4: params}, grid, defines, (("TOKENS", m),))
        return out

    def _dense_rows(self, x: DeviceTensor, data: DeviceTensor, n: int, k: int, kind: str,
                    bias: DeviceTensor | None) -> DeviceTensor:
        """``dense`` through the rows shader (``dense_rows.py``): ``x`` rearranged into token-minor quads
        (``quads.wgsl``) in a buffer every activation window lies inside, then per weight chunk one
        dispatch of 64·ROWS rows per workgroup."""
        m = x.shape[0]
        quads = k // 4  # dense_rows.usable: K is a multiple of 4 (of 8 for 16-bit weights)
        windows = dense_rows.windows_needed(m, k)
        stride = dense_rows.window_quads(m) * 16 * m  # bytes per window
        xt = self.r.empty((quads, m, 4), "f32", min_bytes=(windows - 1) * stride + dense_rows.WINDOW_BYTES)
        grid = self.r.grid(-(-quads * m // 64))
        self.r.dispatch("quads", "main", {0: x, 1: xt, 2: self.r.uniform("4I", m, k, quads, grid[0])}, grid)
        out = self.r.empty((m, n), "f32")
        x_bind = {dense_rows.WINDOW_BINDINGS[c]: (xt, c * stride, dense_rows.WINDOW_BYTES) for c in range(windows)}
        defines = frozenset({f"TOKENS={m}", f"WINDOWS={windows}", f"KIND={kind}", f"ROWS={dense_rows.ROWS}",
                             f"SHARE={w2a8_rows.share_size(self.r.subgroup_size)}"})
        units = k // dense_rows.UNIT[kind]
        for i, chunk in enumerate(data.chunks):
            start = i * data.rows_per_chunk
            rows = min(data.rows_per_chunk, n - start)
            g = self.r.grid(-(-rows // (dense_rows.WG * dense_rows.ROWS)))
            params = self.r.uniform("8I", m, rows, units, int(bias is not None), n, start, g[0], 0)
            self.r.dispatch("dense_rows", "main", {1: chunk, 2: bias if bias is not None else self._zero, 3: out,
                                                   4: params, **x_bind}, g, defines)
        return out

    def _tiled(self, x: DeviceTensor, fn, n: int) -> DeviceTensor:
        """Run ``fn`` on 16-row slices of ``x`` and gather the outputs (rows are independent)."""
        m = x.shape[0]
        out = self.r.empty((m, n), "f32")
        for lo in range(0, m, MAX_TOKENS):  # device-side copies: no host round trip
            part = fn(self.slice_rows(x, lo, min(lo + MAX_TOKENS, m)))
            self.copy_rows(part, out, lo)
        return out

    def slice_rows(self, x: DeviceTensor, lo: int, hi: int) -> DeviceTensor:
        """A device copy of rows ``[lo, hi)`` of a single-chunk tensor."""
        row = int(np.prod(x.shape[1:])) * 4
        dst = self.r.empty((hi - lo, *x.shape[1:]), x.dtype)
        self.r.copy(x.buffer, lo * row, dst.buffer, 0, (hi - lo) * row)
        return dst

    def copy_rows(self, src: DeviceTensor, dst: DeviceTensor, at: int) -> None:
        row = int(np.prod(src.shape[1:])) * 4
        self.r.copy(src.buffer, 0, dst.buffer, at * row, src.shape[0] * row)

    # ---- norms, RoPE, KV, attention ---------------------------------------------------------------------

    def rms_norm(self, x: DeviceTensor, weight: DeviceTensor, eps: float, d: int | None = None) -> DeviceTensor:
        """RMSNorm over rows of length ``d`` (default: the last dimension of ``x``)."""
        d = d or x.shape[-1]
        total = int(np.prod(x.shape))
        if total % d or weight.shape[0] != d:
            raise ShapeError(f"rms_norm: rows of {d} do not fit x {x.shape} / weight {weight.shape}")
        rows = total // d
        out = self.r.empty(x.shape, "f32")
        self.r.dispatch("norm", "main", {0: x, 1: weight, 2: out, 3: self.r.uniform("IIfI", rows, d, eps, 0)},
                        self.r.grid(rows))
        return out

    def rope_(self, x: DeviceTensor, cos: DeviceTensor, sin: DeviceTensor, positions: DeviceTensor) -> None:
        """Rotate ``x f32[M, heads, Dh]`` in place at ``positions u32[M]``."""
        m, heads, dh = x.shape
        n = m * heads * (dh // 2)
        self.r.dispatch("rope", "main", {0: x, 1: cos, 2: sin, 3: positions,
                                         4: self.r.uniform("4I", m, heads, dh, 0)}, (-(-n // 64), 1, 1))

    def kv_write(self, src: DeviceTensor, cache: DeviceTensor, positions: DeviceTensor) -> None:
        """``cache[h, positions[m], :] = src[m, h, :]`` for ``src f32[M, kv_heads, Dh]`` and a
        ``[kv_heads, S, Dh]`` cache."""
        m, kvh, dh = src.shape
        if cache.shape[0] != kvh or cache.shape[2] != dh:
            raise ShapeError(f"kv_write: rows {src.shape} do not fit cache {cache.shape}")
        n = m * kvh * dh
        self.r.dispatch("kv_write", "main", {0: src, 1: cache, 2: positions,
                                             3: self.r.uniform("4I", m, kvh, dh, cache.shape[1])}, (-(-n // 64), 1, 1))

    def attention(self, q: DeviceTensor, kc: DeviceTensor, vc: DeviceTensor, mask: DeviceTensor,
                  scale: float) -> DeviceTensor:
        """``q f32[M, H, Dh]`` over cache rows ``[0, L)`` under ``mask u32[M, L]`` (non-zero = visible).
        Masked cache rows are never read, so whatever they hold (NaN, Inf) cannot reach the output."""
        m, h, dh = q.shape
        kvh, s, _ = kc.shape
        length = mask.shape[1]
        if length > MAX_SEGMENT or length > s:
            raise ShapeError(f"attention: segment of {length} rows exceeds the cache ({s}) or the shader's "
                             f"workgroup score buffer ({MAX_SEGMENT})")
        if h % kvh:
            raise ShapeError(f"attention: {kvh} KV heads do not divide {h} heads")
        out = self.r.empty((m, h, dh), "f32")
        params = self.r.uniform("6IfI", m, h, kvh, dh, s, length, scale, 0)
        self.r.dispatch("attention", "main", {0: q, 1: kc, 2: vc, 3: mask, 4: out, 5: params}, (m, h, 1))
        return out

    # ---- element-wise, argmax, gather --------------------------------------------------------------------

    def _elementwise(self, entry: str, a: DeviceTensor, b: DeviceTensor | None, shape, inner: int) -> DeviceTensor:
        n = int(np.prod(shape))
        out = self.r.empty(shape, "f32")
        groups = -(-n // 64)
        grid = (groups, 1, 1) if groups <= 65535 else (65535, -(-groups // 65535), 1)
        bindings = {0: a, 2: out, 3: self.r.uniform("4I", n, inner, 0, 0)}
        if b is not None:  # only "add" reads b; "auto" layouts hold only the bindings an entry uses
            bindings[1] = b
        self.r.dispatch("elementwise", entry, bindings, grid)
        return out

    def add(self, a: DeviceTensor, b: DeviceTensor) -> DeviceTensor:
        if a.shape != b.shape:
            raise ShapeError(f"add: shapes {a.shape} and {b.shape} differ")
        return self._elementwise("add", a, b, a.shape, 1)

    def gated(self, gate_up: DeviceTensor, act: str) -> DeviceTensor:
        """``act(gate) * up`` of a fused ``[M, 2I]`` buffer; ``act`` is ``silu`` or ``relu2``."""
        if act not in ("silu", "relu2"):
            raise BitMTPError(f"act: expected 'silu' or 'relu2', got {act!r}")
        m, two_i = gate_up.shape
        return self._elementwise(f"{act}_mul", gate_up, None, (m, two_i // 2), two_i // 2)

    def argmax(self, logits: DeviceTensor, out: DeviceTensor | None = None, offset: int = 0) -> DeviceTensor:
        """Each row's argmax and its softmax probability into ``out u32[2W]``: ids at ``[offset + m]``, the
        probability's float bits at ``[W + offset + m]`` (one buffer, so a step's results are one read)."""
        m, v = logits.shape
        out = out or self.r.empty((2 * m,), "u32")
        w = out.shape[0] // 2
        if offset + m > w:
            raise ShapeError(f"argmax: rows {offset}..{offset + m} do not fit an output of width {w}")
        self.r.dispatch("argmax", "main", {0: logits, 1: out, 2: self.r.uniform("4I", m, v, offset, w)}, (m, 1, 1))
        return out

    @staticmethod
    def split_argmax(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, probs)`` of an :meth:`argmax` output read back to the host."""
        w = raw.shape[0] // 2
        return raw[:w].astype(np.int64), raw[w:].view(np.float32)

    def cols(self, x: DeviceTensor, c0: int, width: int) -> DeviceTensor:
        """Columns ``[c0, c0 + width)`` of ``x f32[M, C]`` (q, k, v of a fused projection)."""
        m, c = x.shape
        out = self.r.empty((m, width), "f32")
        n = m * width
        groups = -(-n // 64)
        grid = (groups, 1, 1) if groups <= 65535 else (65535, -(-groups // 65535), 1)
        self.r.dispatch("elementwise", "cols", {0: x, 2: out, 3: self.r.uniform("4I", n, width, c, c0)}, grid)
        return out

    def add_into(self, y: DeviceTensor, delta: DeviceTensor, first_row: int) -> None:
        """``y[first_row:] += delta`` (rows of equal length), in place."""
        row = int(np.prod(y.shape[1:]))
        n = int(np.prod(delta.shape))
        if first_row * row + n > int(np.prod(y.shape)):
            raise ShapeError(f"add_into: {delta.shape} at row {first_row} does not fit {y.shape}")
        self.r.dispatch("elementwise", "add_into", {0: delta, 2: y, 3: self.r.uniform("4I", n, 1, 0, first_row * row)},
                        (-(-n // 64), 1, 1))

    def mask(self, positions: DeviceTensor, length: int, causal_rows: int, out: DeviceTensor | None = None
             ) -> DeviceTensor:
        """The step mask ``u32[M, L]``: row i sees KV rows ≤ its position (first ``causal_rows`` rows) or ≤ the
        last row's position (a draft step's mask rows)."""
        m = positions.shape[0]
        out = out or self.r.empty((m, length), "u32")
        self.r.dispatch("mask", "main", {0: positions, 1: out, 2: self.r.uniform("4I", m, length, causal_rows, 0)},
                        (-(-(m * length) // 64), 1, 1))
        return out

    def prepare_verify(self, draft_out: DeviceTensor, draft_pos: DeviceTensor, pending: int, d: int,
                       tokens: DeviceTensor, positions: DeviceTensor) -> None:
        """Verify inputs from a draft step's outputs, on the device (see step.wgsl)."""
        w = draft_out.shape[0] // 2
        params = self.r.uniform("4I", d, w - d, 0, pending - 1)
        self.r.dispatch("step", "prepare", {0: draft_out, 1: draft_pos, 3: tokens, 4: positions, 5: params}, (1, 1, 1))

    def resolve_verify(self, verify_out: DeviceTensor, verify_pos: DeviceTensor, verify_tok: DeviceTensor,
                       tokens: DeviceTensor, positions: DeviceTensor) -> None:
        """The next draft step's inputs from a verify step's outputs, on the device (see step.wgsl)."""
        d = verify_tok.shape[0]
        params = self.r.uniform("4I", d, 0, positions.shape[0], 0)
        self.r.dispatch("step", "resolve", {0: verify_out, 1: verify_pos, 2: verify_tok, 3: tokens, 4: positions,
                                            5: params}, (1, 1, 1))

    def gather(self, table: DeviceTensor | DenseWeight, tokens: DeviceTensor, count: int | None = None,
               offset: int = 0, out: DeviceTensor | None = None) -> DeviceTensor:
        """Embedding rows ``table[tokens[offset : offset + count]]`` → ``f32[count, H]`` (into ``out``'s first
        rows when given). A row-chunked table (a tied LM head larger than one binding) is gathered per chunk."""
        data, v, h, _, defines = _dense_parts(table)
        m = count or tokens.shape[0]
        out = out or self.r.empty((m, h), "f32")
        for i, chunk in enumerate(data.chunks):
            start = i * data.rows_per_chunk
            rows = min(data.rows_per_chunk, v - start)
            params = self.r.uniform("8I", m, h, offset, start, rows, 0, 0, 0)
            self.r.dispatch("gather", "main", {0: chunk, 1: tokens, 2: out, 3: params}, (-(-(m * h) // 64), 1, 1),
                            defines)
        return out

    @staticmethod
    def view(t: DeviceTensor, shape: tuple[int, ...]) -> DeviceTensor:
        """The same single-chunk buffer with another shape (same number of elements)."""
        if int(np.prod(shape)) != int(np.prod(t.shape)) or len(t.chunks) != 1:
            raise ShapeError(f"view: cannot view {t.shape} ({len(t.chunks)} chunks) as {shape}")
        return DeviceTensor(tuple(shape), t.dtype, t.chunks, shape[0], t.runner)


__all__ = ["Ops", "TernaryWeight", "DenseWeight", "MAX_TOKENS", "MAX_SEGMENT"]
