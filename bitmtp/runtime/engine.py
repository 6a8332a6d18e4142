"""The decode engine: prefill in fixed-width chunks, then AR decoding (role ``ar``, width 1)
through the graph pool, over one in-place KV store.

Per AR step the host writes the static inputs (token, position), replays the step, and reads
one token back: exactly one device→host synchronization per generated token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import Decoder
from bitmtp.runtime.graphs import GraphPool
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.states import ReplayState


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded), why generation stopped, and timing."""

    tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "capacity"
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: generated tokens after the first, over decode time."""
        return max(len(self.tokens) - 1, 0) / self.decode_seconds if self.decode_seconds > 0 else float("nan")


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
                 eager: bool | None = None, keep_logits: bool = False):
        a = decoder.args
        if capacity + m_max > decoder.rope_cos.shape[0]:
            raise BitMTPError(
                f"capacity: {capacity} + {m_max} rows exceed the model's RoPE table "
                f"({decoder.rope_cos.shape[0]} positions); lower capacity"
            )
        self.decoder = decoder
        self.kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, capacity, m_max,
                          dtype=decoder.dtype, device=decoder.device)
        self.pool = GraphPool(decoder, self.kv, eager=eager, keep_logits=keep_logits)
        self.prefill_chunk = int(prefill_chunk)
        self.n = 0  # committed tokens whose KV rows [0, n) are materialized (host mirror)
        self.syncs = 0  # device→host reads (tests count them)

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
        self.syncs += 1
        return int(runner.out_token[-1])  # the one device→host read of the prefill

    def ar_step(self, token: int) -> int:
        """Feed one committed token at position ``n`` (its KV is written, n += 1); return the next argmax."""
        if self.n >= self.capacity:
            raise BitMTPError(f"capacity: the KV store is full ({self.capacity} tokens)")
        runner = self._step("ar", int(token), self.n)
        self.n += 1
        self.syncs += 1
        return int(runner.out_token[0])  # the one device→host sync of this step

    def generate_ar(self, input_ids: Iterable[int], max_new_tokens: int, eos_token_id: Iterable[int] = (),
                    on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Greedy AR generation from a fresh sequence."""
        if max_new_tokens < 1:
            raise BitMTPError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        eos = set(int(e) for e in eos_token_id)
        self.reset()
        ids = list(input_ids)
        t0 = time.perf_counter()
        tok = self.prefill(ids)
        t1 = time.perf_counter()
        out = [tok]
        if on_token:
            on_token(tok)
        reason = "eos" if tok in eos else "max_new_tokens"
        while tok not in eos and len(out) < max_new_tokens:
            if self.n >= self.capacity:
                reason = "capacity"
                break
            tok = self.ar_step(tok)
            out.append(tok)
            if on_token:
                on_token(tok)
            if tok in eos:
                reason = "eos"
        t2 = time.perf_counter()
        return GenerationResult(out, reason, len(ids), t1 - t0, t2 - t1,
                                stats={"steps": len(out) - 1, "syncs": self.syncs})
