"""The shared KV store: one buffer per layer for K and one for V, allocated once.

Layout per layer: ``[kv_heads, capacity + M_max, head_dim]``. A step writes its rows in place at
their absolute positions (``index_copy_`` with a device tensor of positions — no host sync, graph
capturable) and reads rows ``[0, L)`` where L is the step's segment length. Rows a step wrote
but the policy rejected are simply overwritten by the next step that owns those positions. There is
no promotion, compaction or segment migration: the one copy within a generation is :meth:`move_row`, which the
``top2`` schedule uses when it accepts the runner-up of a first guess (that row was written to a scratch slot
beside the first guess's): one row per layer, counted in ``rows_copied``, which every other schedule leaves at
zero (tests assert it, and that the buffers never move). The batch store also copies whole prompt prefixes between
sequences' ranges before a step (:meth:`copy_rows`, counted in ``rows_shared``).
"""

from __future__ import annotations

import math
import mmap

import torch

from bitmtp.errors import BitMTPError

#: Smallest segment (read length); segments double up to the store's full length.
MIN_SEGMENT = 256


def _lazy_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """``count`` zero CPU tensors of ``shape`` over one anonymous memory map (each at a page boundary), and the
    map (keep it with them). The kernel hands out zero pages on first touch, so a store costs resident memory
    only for the rows steps have written: a 1-token CLI call on SmolLM2 kept ~2 MB of its 96 MB store resident
    instead of all of it (torch.zeros writes every page), and the allocation is free. Huge pages are declined
    (``MADV_NOHUGEPAGE``), so touching a row never brings in 2 MB of neighbours."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    stride = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, max(stride * count, mmap.PAGESIZE))  # anonymous, private, zero-filled
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    return mapping, [flat[i * stride: i * stride + nbytes].view(dtype).view(shape) for i in range(count)]


class KVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, m_max: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise BitMTPError(f"capacity: must be >= 1 token, got {capacity}")
        if m_max < 1:
            raise BitMTPError(f"m_max: must be >= 1, got {m_max}")
        self.capacity = int(capacity)
        self.m_max = int(m_max)
        self.rows = self.capacity + self.m_max
        shape = (num_kv_heads, self.rows, head_dim)
        if torch.device(device).type == "cpu":
            self._mapping, buffers = _lazy_zeros(2 * num_layers, shape, dtype)
            self.k, self.v = buffers[:num_layers], buffers[num_layers:]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows_copied = 0  # rows moved by move_row (the top2 schedule's accepted runner-ups); else 0
        self.rows_shared = 0  # rows copied by copy_rows (the batch's shared prompt prefixes)
        self.segments = self._segments()

    def _segments(self) -> list[int]:
        segs, s = [], MIN_SEGMENT
        while s < self.rows:
            segs.append(s)
            s *= 2
        segs.append(self.rows)
        return segs

    def segment_for(self, end: int) -> int:
        """Smallest segment length covering rows ``[0, end)``."""
        if end > self.rows:
            raise BitMTPError(f"kv: rows [0, {end}) exceed the store ({self.capacity} + {self.m_max} rows)")
        for s in self.segments:
            if s >= end:
                return s
        return self.rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.k + self.v]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [M, kv_heads, D]`` at rows ``positions`` of ``layer``; return the layer's whole
        buffers (the step reads rows ``[0, L)`` of them, L being its mask's column count)."""
        kb, vb = self.k[layer], self.v[layer]
        kb.index_copy_(1, positions, k.transpose(0, 1).to(kb.dtype))
        vb.index_copy_(1, positions, v.transpose(0, 1).to(vb.dtype))
        return kb, vb

    def move_row(self, src: int, dst: int) -> None:
        """Copy KV row ``src`` onto row ``dst`` in every layer (K and V): a ``top2`` step's accepted runner-up,
        written to a scratch slot, becomes the committed row of its position. ~60 row copies for SmolLM2's
        30 layers, against a ~10 ms step: it runs only in the iterations that accept a runner-up."""
        if not (0 <= src < self.rows and 0 <= dst < self.rows):
            raise BitMTPError(f"kv: move_row({src}, {dst}) outside the store's {self.rows} rows")
        for buf in (*self.k, *self.v):
            buf[:, dst].copy_(buf[:, src])
        self.rows_copied += 1

    def copy_rows(self, src: int, dst: int, count: int) -> None:
        """Copy rows ``[src, src + count)`` onto rows ``[dst, dst + count)`` in every layer (K and V), ranges that
        must not overlap: the batch's prompt-prefix sharing (``runtime.batch_schedule``) gives a new sequence the
        rows another sequence wrote for the same first tokens at the same positions. SmolLM2: 60 slice copies,
        ~0.3 ms, against ~2.4 ms a row to prefill them. Counted in ``rows_shared``."""
        if count <= 0:
            return
        if not (0 <= src and src + count <= self.rows and 0 <= dst and dst + count <= self.rows):
            raise BitMTPError(f"kv: copy_rows({src}, {dst}, {count}) outside the store's {self.rows} rows")
        if src < dst + count and dst < src + count:
            raise BitMTPError(f"kv: copy_rows({src}, {dst}, {count}): the ranges overlap")
        for buf in (*self.k, *self.v):
            buf[:, dst : dst + count].copy_(buf[:, src : src + count])
        self.rows_shared += count


def reusable_prefix(ids: list[int], kept: list[int]) -> int:
    """How many first tokens of the prompt ``ids`` have their KV rows among rows holding ``kept``: the tokens they
    share, leaving the prompt's last (its row's choice is the first token, so it always runs). The prompt-prefix
    cache's rule, for the solo engine (``Engine.resume``) and the batch (``BatchSchedule``)."""
    n, limit = 0, min(len(ids) - 1, len(kept))
    while n < limit and ids[n] == kept[n]:
        n += 1
    return n

