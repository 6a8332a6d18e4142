"""Small building blocks of the decoder: RMSNorm, activations, RoPE tables, dense linear module, lazy weights."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from bitmtp.errors import ShapeError
from bitmtp.formats.ggml_blocks import GGML_FORMATS, BlockWeight, dequantize, dequantize_rows, pack_lossless
from bitmtp.ops import dense_linear
from bitmtp.ops.linear import dense_reads_blocks
from bitmtp.ops.reference import rms_norm_reference as rms_norm  # noqa: F401  (re-exported: the one definition)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU evaluated in float64 and rounded to ``x``'s dtype: as order- and library-independent as
    ``rms_norm`` (float32 ``exp`` differs by an ulp between torch's vector code and libm)."""
    return torch.nn.functional.silu(x.double()).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """BitNet's squared ReLU, ``relu(x)²`` in ``x``'s dtype (exact: one rounding, as the native kernels do)."""
    return torch.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (transformers' ``gelu_pytorch_tanh``), evaluated in float64 and
    rounded to ``x``'s dtype like :func:`silu`. Only the torch executor implements it."""
    return torch.nn.functional.gelu(x.double(), approximate="tanh").to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float32), with llama3 scaling when configured."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type") != "llama3":
        return inv
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def rope_tables(head_dim: int, theta: float, scaling: dict | None, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[positions, head_dim]`` (halves duplicated, transformers' layout)."""
    inv = rope_inv_freq(head_dim, theta, scaling)
    t = torch.arange(positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x[M, heads, D]`` rotated by per-row ``cos/sin[M, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def changes_tensors(fn) -> bool:
    """Whether ``Module._apply``'s ``fn`` makes new tensors of float32 CPU ones (``.to(bfloat16)``, ``.cuda()``)
    rather than returning them as they are (``.to("cpu")``, ``.float()`` on float32): a lazy weight is
    materialized only for the former, so ``decoder.to(device)`` on the CPU keeps the blocks alone."""
    probe = torch.empty(0)
    try:
        return fn(probe) is not probe
    except Exception:  # noqa: BLE001 - whatever fn does, it is not the identity: convert the float tensor
        return True


#: integer dtypes token ids come in
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def _row_index(index: Any, n: int) -> tuple[torch.Tensor, tuple[int, ...], tuple] | None:
    """``(rows int64 [R], leading output shape, index left for the columns)`` of ``tensor[index]`` on an ``[n, K]``
    tensor, for the indices an embedding lookup uses (ints, slices, integer or boolean tensors, lists); None for
    any other index (the caller takes the materialized tensor)."""
    rest: tuple = ()
    if isinstance(index, tuple):
        if not index:
            return None
        index, rest = index[0], index[1:]
        if any(r is None or r is Ellipsis for r in rest):
            return None
    if isinstance(index, bool):
        return None
    if isinstance(index, int):
        return torch.arange(n)[index].reshape(1), (), rest
    if isinstance(index, slice):
        rows = torch.arange(n)[index]
        return rows, (rows.numel(),), rest
    if isinstance(index, list):
        index = torch.tensor(index)
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            rows = torch.arange(n)[index.cpu()]
            return rows, (rows.numel(),), rest
        if index.is_floating_point() or index.is_complex():
            return None
        flat = index if index.dim() == 1 else index.reshape(-1)  # (no call a step's 1-d ids do not need)
        return flat if flat.device.type == "cpu" else flat.cpu(), tuple(index.shape), rest
    return None


class LazyWeight:
    """A float32 ``[N, K]`` weight held as its GGML blocks (``bitmtp.formats.ggml_blocks``) until a path that
    computes from floats asks for it: the native CPU kernels read the blocks, so a GGUF model's float32 copy
    (4-6x the file's bytes) is never made on the default path. :meth:`rows` dequantizes only the rows asked for
    (embedding lookups); :meth:`materialize` the whole tensor, once, shared by every holder of this object (a tied
    embedding and LM head get one tensor, as a float checkpoint's do). Both are ``ggml_blocks.dequantize`` bit
    for bit."""

    #: most bytes of decoded rows :meth:`rows` keeps (a decode step looks up one token: from this cache, one torch op
    #: instead of the six a decode takes, cold after the layers — ~80 us a SmolLM2 step)
    ROW_CACHE_BYTES = 16 << 20
    #: lookups of at most this many rows go through the cache (a decode step's, a prefill chunk's)
    ROW_CACHE_LOOKUP = 64

    def __init__(self, blocks: BlockWeight):
        self.blocks = blocks
        self._tensor: nn.Parameter | None = None
        self._record: tuple[int, int] = (0, 0)  # (data_ptr, _version) of the tensor when it was made
        self._row_cache: dict[int, torch.Tensor] = {}
        self._row_cap = max(self.ROW_CACHE_BYTES // max(4 * blocks.shape[1], 1), self.ROW_CACHE_LOOKUP)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.blocks.shape)

    @property
    def materialized(self) -> nn.Parameter | None:
        """The float tensor if :meth:`materialize` ran, else None."""
        return self._tensor

    def materialize(self) -> nn.Parameter:
        """The dequantized float32 weight (a frozen Parameter), made on the first call."""
        if self._tensor is None:
            t = nn.Parameter(dequantize(self.blocks), requires_grad=False)
            self._tensor, self._record = t, (t.data_ptr(), t._version)
        return self._tensor

    def record(self) -> tuple[BlockWeight, torch.Tensor, int, int]:
        """``DenseLinear``'s record of blocks encoding the materialized tensor as it was made (an in-place change
        since then drops them)."""
        return self.blocks, self.materialize(), *self._record

    def rows(self, index: Any) -> torch.Tensor:
        """``materialize()[index]``, decoding only the rows ``index`` selects (the materialized tensor when it
        exists)."""
        if self._tensor is not None:
            return self._tensor[index]
        if isinstance(index, torch.Tensor) and index.dtype in _ID_DTYPES and index.dim() == 1 \
                and index.device.type == "cpu":  # a step's ids (no parsing)
            parsed = (index, (index.shape[0],), ())
        else:
            parsed = _row_index(index, self.blocks.shape[0])
        if parsed is None:
            return self.materialize()[index]
        rows, lead, rest = parsed
        if not rest and len(lead) == 1 and rows.numel() <= self.ROW_CACHE_LOOKUP:
            return self._cached_rows(rows)
        out = dequantize_rows(self.blocks, rows).reshape(*lead, self.blocks.shape[1])
        return out[(slice(None),) * len(lead) + rest] if rest else out

    def _cached_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (a few ids) from the decoded-row cache, decoding the ones it lacks (bit-identical: the same
        :func:`dequantize_rows`); a new tensor every call. The cache is cleared when full; a thread that finds it
        cleared meanwhile still has the rows it decoded."""
        ids = rows.tolist()
        cache = self._row_cache
        found = {t: cache.get(t) for t in ids}
        miss = [t for t, row in found.items() if row is None]
        if miss:  # out-of-range ids raise here, as dequantize_rows does
            got = dequantize_rows(self.blocks, torch.tensor(miss, dtype=torch.long))
            if len(cache) + len(miss) > self._row_cap:
                cache.clear()
            for t, row in zip(miss, got, strict=True):
                found[t] = cache[t] = row
        if not ids:
            return torch.empty((0, self.blocks.shape[1]), dtype=torch.float32, device=self.blocks.data.device)
        return torch.stack([found[t] for t in ids])


class BlockEmbedding:
    """What ``Decoder.embed`` is while the embedding is held as GGML blocks (:class:`LazyWeight`): lookups
    (``embed[token_ids]``, ``embed[:8]``) dequantize only the rows they select, bit-identical to indexing the float
    tensor; ``shape``, ``dtype``, ``device``, ``len()`` and ``size()`` read nothing. Anything else a tensor offers
    (``.detach()``, ``.mean(0)``, ``.data = …``, passing it to a torch function) materializes the float embedding on
    its decoder (``Decoder.materialize_embed``) and applies to that, so float paths (training, the Vulkan upload)
    work unchanged and :attr:`Decoder.embed` is the plain Parameter afterwards."""

    __slots__ = ("_decoder", "_lazy")

    def __init__(self, decoder: nn.Module, lazy: LazyWeight):
        object.__setattr__(self, "_decoder", decoder)
        object.__setattr__(self, "_lazy", lazy)

    def materialize(self) -> nn.Parameter:
        """The float32 embedding (made once, then kept by the decoder)."""
        return self._decoder.materialize_embed()

    @property
    def blocks(self) -> BlockWeight:
        return self._lazy.blocks

    @property
    def shape(self) -> torch.Size:
        return self._lazy.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self._lazy.blocks.data.device

    @property
    def ndim(self) -> int:
        return 2

    def dim(self) -> int:
        return 2

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._lazy.rows(index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.materialize(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.materialize(), name, value)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(v: Any) -> Any:
            if isinstance(v, BlockEmbedding):
                return v.materialize()
            if isinstance(v, (list, tuple)):
                return type(v)(real(x) for x in v)
            return v

        return func(*real(tuple(args)), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"BlockEmbedding(shape={tuple(self.shape)}, blocks={self._lazy.blocks.fmt})"


class DenseLinear(nn.Module):
    """A dense projection (embedding-side, LM head, non-ternary checkpoints) through ``ops.dense_linear``.

    Built from a float ``weight``, or lazily from GGML blocks (``weight=None, blocks=``, a GGUF file's Q4_0 /
    Q4_1 / Q8_0 tensor): then the module holds no float tensor — the CPU kernels read the blocks — until something
    reads ``.weight`` (a float path: the torch reference backend, another device or dtype, training, export, the
    Vulkan upload), which dequantizes it once (:class:`LazyWeight`) and keeps it, exactly as if it had been built
    from the floats. :meth:`pack_blocks` adds a block copy of a float weight when one reproduces it exactly:
    CPU kernels then read the blocks — bit-identical results, a fraction of the bytes. The blocks are dropped
    by themselves when ``weight`` is replaced, moved or modified in place.
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, backend: str | None = None,
                 *, blocks: BlockWeight | LazyWeight | None = None):
        super().__init__()
        self._lazy: LazyWeight | None = None
        self._blocks: tuple[BlockWeight, torch.Tensor, int, int] | None = None
        if weight is None:
            if blocks is None:
                raise ShapeError("DenseLinear: pass a float weight, or its GGML blocks as blocks=")
            self._lazy = blocks if isinstance(blocks, LazyWeight) else LazyWeight(blocks)
            self.out_features, self.in_features = self._lazy.blocks.shape
        else:
            self.out_features, self.in_features = weight.shape
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
            if blocks is not None:  # the caller guarantees blocks encode weight bit for bit
                bw = blocks.blocks if isinstance(blocks, LazyWeight) else blocks
                if tuple(bw.shape) != tuple(weight.shape):
                    raise ShapeError(f"blocks: a {bw.shape} {bw.fmt} weight does not encode weight "
                                     f"{tuple(weight.shape)}")
                w = self.weight
                self._blocks = (bw, w, w.data_ptr(), w._version)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.backend = backend

    def _pending(self) -> LazyWeight | None:
        """The lazy weight while no float tensor is in place; adopts the shared tensor once another holder
        (the tied embedding) has materialized it."""
        lazy = self.__dict__.get("_lazy")
        if lazy is None:
            return None
        if "weight" in self._parameters:  # a weight was assigned: the blocks no longer describe it
            self._lazy = None
            return None
        if lazy.materialized is not None:
            self._adopt(lazy)
            return None
        return lazy

    def _adopt(self, lazy: LazyWeight) -> nn.Parameter:
        bw, w, ptr, version = lazy.record()
        self._parameters["weight"] = w
        self._blocks = (bw, w, ptr, version)
        self._lazy = None
        return w

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and self._pending() is not None:  # a float path: dequantize once, keep
            return self._adopt(self._lazy)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # replacing the weight forgets the lazy one (nothing to dequantize for it)
            self.__dict__["_lazy"] = None
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        if self._pending() is not None and changes_tensors(fn):
            self._adopt(self._lazy)
        return super()._apply(fn, recurse)

    @property
    def lazy(self) -> bool:
        """Whether the weight is held only as blocks (no float tensor made yet)."""
        return self._pending() is not None

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype (float32 while lazy), without materializing it."""
        return torch.float32 if self._pending() is not None else self.weight.dtype

    @property
    def blocks(self) -> BlockWeight | None:
        """The weight's GGML blocks, if packed and still the weight's exact encoding."""
        lazy = self._pending()
        if lazy is not None:
            return lazy.blocks
        if self._blocks is None:
            return None
        bw, w, ptr, version = self._blocks
        if w is not self.weight or w.data_ptr() != ptr or w._version != version:
            self._blocks = None
            return None
        return bw

    def rows(self, index: Any) -> torch.Tensor:
        """``weight[index]`` (float rows), dequantizing only those rows while the weight is lazy."""
        lazy = self._pending()
        return self.weight[index] if lazy is None else lazy.rows(index)

    def pack_blocks(self, formats: tuple[str, ...] = GGML_FORMATS) -> BlockWeight | None:
        """Keep a block copy of the weight when one of ``formats`` encodes it losslessly; returns it (a lazy
        weight's own blocks, in whatever format, without fitting anything). The default looks for the GGML
        formats only: a ``bf16`` / ``f16`` copy beside a float32 weight would add half its bytes (pass
        ``ggml_blocks.FORMATS`` to trade that memory for half the bytes a CPU step reads)."""
        lazy = self._pending()
        if lazy is not None:
            return lazy.blocks
        bw = pack_lossless(self.weight.detach(), formats)
        w = self.weight
        self._blocks = None if bw is None else (bw, w, w.data_ptr(), w._version)
        return bw

    def drop_blocks(self) -> None:
        """Forget the block copy (a lazy weight is materialized first): the float32 kernels run again."""
        if self._pending() is not None:
            self._adopt(self._lazy)
        self._blocks = None

    def operands(self, device: torch.device) -> tuple[torch.Tensor | None, BlockWeight | None]:
        """``(weight, blocks)`` as :func:`~bitmtp.ops.linear.dense_linear` takes them for inputs on ``device``: the
        float weight (None while lazy, where the op reads the blocks itself) and the blocks (None without)."""
        blocks = self.blocks
        weight = self._parameters.get("weight")
        if weight is None and not dense_reads_blocks(device, self.backend):
            weight = self.weight  # this path computes from the float weight: made once, kept
        return weight, blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, blocks = self.operands(x.device)
        return dense_linear(x, weight, self.bias, backend=self.backend, blocks=blocks)

    def extra_repr(self) -> str:
        blocks = self.blocks
        kept = "" if blocks is None else f", blocks={blocks.fmt}" + (" (lazy)" if self.lazy else "")
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}{kept}"
