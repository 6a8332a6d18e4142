"""The decode engine: prefill in fixed-width chunks, then AR or MTP decoding (``runtime/decode.py``)
through the graph pool, over one in-place KV store.

Every device→host transfer of the decode loop goes through :meth:`Engine.read`, which counts it:
one per AR step, one per MTP iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import Decoder
from bitmtp.runtime.decode import GenerationResult, decode
from bitmtp.runtime.graphs import GraphPool
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.states import ReplayState


class Engine:
    """Owns the KV store and graph pool of one decoder.

    Args:
        decoder: the model.
        capacity: maximum committed tokens (prompt + generated).
        m_max: widest replay step (2D − 1 for block size D; 16 covers D = 8).
        prefill_chunk: prefill width.
        eager: force eager steps on CUDA (default: ``BITMTP_EAGER``).
    """

    def __init__(self, decoder: Decoder, *, capacity: int = 2048, m_max: int = 16, prefill_chunk: int = 64,
                 eager: bool | None = None, keep_logits: bool = False, device_backend: str | None = None,
                 gpu_layers: int | None = None):
        a = decoder.args
        if capacity + m_max > decoder.rope_cos.shape[0]:
            raise BitMTPError(
                f"capacity: {capacity} + {m_max} rows exceed the model's RoPE table "
                f"({decoder.rope_cos.shape[0]} positions); lower capacity"
            )
        self.decoder = decoder
        self.kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, capacity, m_max,
                          dtype=decoder.dtype, device=decoder.device)
        if device_backend == "wgpu":  # whole layers on a Vulkan device, the plan's tail on the CPU
            from bitmtp.runtime.wgpu_exec import WgpuGraphPool

            self.pool = WgpuGraphPool(decoder, self.kv, gpu_layers=gpu_layers)
        elif device_backend is not None:
            raise BitMTPError(f"device_backend: expected None or 'wgpu', got {device_backend!r}")
        else:
            self.pool = GraphPool(decoder, self.kv, eager=eager, keep_logits=keep_logits)
        self.prefill_chunk = int(prefill_chunk)
        self.n = 0  # committed tokens whose KV rows [0, n) are materialized (host mirror)
        self.syncs = 0  # device→host reads (tests count them)
        self.last_stats = None  # the DecodeStats of the latest decode() (filled as it runs)
        # static helpers of the decode loop, allocated once (no allocation in the loop)
        self.arange = torch.arange(max(m_max, prefill_chunk) + 1, device=decoder.device)
        self._staging = torch.zeros(4 * (m_max + 1), dtype=torch.float64, device=decoder.device)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def reset(self) -> None:
        """Forget the sequence (rows are overwritten by the next prefill; nothing is cleared or copied)."""
        self.n = 0

    def _step(self, role: str, tokens: torch.Tensor | int, start: int):
        """Fill the static inputs of the state's runner in place (an int fills a width-1 step without
        building a host tensor) and run it."""
        m = 1 if isinstance(tokens, int) else tokens.numel()
        state = ReplayState(m, self.kv.segment_for(start + m), role)
        runner = self.pool.get(state)
        if isinstance(tokens, int):
            runner.tokens.fill_(tokens)
        else:
            runner.tokens.copy_(tokens, non_blocking=True)
        torch.arange(start, start + m, out=runner.positions)
        runner.run()
        return runner

    def prefill(self, ids: Iterable[int]) -> int:
        """Materialize the KV of ``ids`` from position ``self.n`` on; return the argmax after the last one."""
        ids_t = torch.as_tensor(list(ids), dtype=torch.long)
        if ids_t.numel() == 0:
            raise BitMTPError("input_ids: the prompt is empty")
        if self.n + ids_t.numel() > self.capacity:
            raise BitMTPError(
                f"input_ids: prompt of {ids_t.numel()} tokens (+{self.n} committed) exceeds capacity {self.capacity}"
            )
        runner = None
        for lo in range(0, ids_t.numel(), self.prefill_chunk):
            chunk = ids_t[lo : lo + self.prefill_chunk]
            runner = self._step("prefill", chunk, self.n)
            self.n += chunk.numel()
        (last,) = self.read(runner.out_token[-1:])  # the one device→host read of the prefill
        return last[0]

    def ar_step(self, token: int) -> int:
        """Feed one committed token at position ``n`` (its KV is written, n += 1); return the next argmax."""
        if self.n >= self.capacity:
            raise BitMTPError(f"capacity: the KV store is full ({self.capacity} tokens)")
        runner = self._step("ar", int(token), self.n)
        self.n += 1
        (tok,) = self.read(runner.out_token[:1])  # the one device→host sync of this step
        return tok[0]

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Bring small device tensors to the host in ONE transfer (the instrumented sync point).

        The tensors are gathered into a float64 staging buffer on the device (token ids < 2^53 are
        exact in float64) and read with a single ``tolist``; integer tensors come back as ints. A pool
        that keeps outputs on another device (wgpu) brings them all over first, in one read.
        """
        flush = getattr(self.pool, "flush", None)
        if flush is not None:
            flush()
        if len(tensors) == 1:
            self.syncs += 1
            return [tensors[0].tolist()]
        sizes = [t.numel() for t in tensors]
        lo = 0
        for t, k in zip(tensors, sizes, strict=True):
            self._staging[lo : lo + k].copy_(t.reshape(-1))
            lo += k
        flat = self._staging[:lo].tolist()
        self.syncs += 1
        out, lo = [], 0
        for t, k in zip(tensors, sizes, strict=True):
            part = flat[lo : lo + k]
            out.append([int(v) for v in part] if not t.is_floating_point() else part)
            lo += k
        return out

    def decode(self, input_ids: Iterable[int], **kwargs) -> Iterator[list[int]]:
        """The decode loop as a generator of committed token chunks (see ``runtime/decode.py``);
        its return value (``StopIteration.value``) is the :class:`GenerationResult`."""
        return decode(self, list(input_ids), **kwargs)

    def generate_ar(self, input_ids: Iterable[int], max_new_tokens: int, eos_token_id: Iterable[int] = (),
                    on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Greedy AR generation from a fresh sequence."""
        return self.run(self.decode(input_ids, max_new_tokens=max_new_tokens, eos=list(eos_token_id), policy="ar"),
                        on_token)

    @staticmethod
    def run(chunks: Iterator[list[int]], on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Drain a :meth:`decode` generator (calling ``on_token`` per committed token); return its result."""
        while True:
            try:
                chunk = next(chunks)
            except StopIteration as stop:
                return stop.value
            if on_token:
                for t in chunk:
                    on_token(t)
