"""The decode engine: prefill in fixed-width chunks, then AR or MTP decoding (``runtime/decode.py``)
through the graph pool, over one in-place KV store.

Every device→host transfer of the decode loop goes through :meth:`Engine.read`, which counts it:
one per AR step, one per MTP iteration.

One generation owns the KV store at a time. The store is a single set of buffers written in place,
so two sequences decoded on one engine at once would write each other's rows and both come out
wrong without a word. :meth:`Engine.decode` therefore returns a :class:`Generation` that takes the
engine's lock at its first step and holds it until it is exhausted, fails, is closed or is garbage
collected. A generation started in another thread waits for it (calls serialize); one started in
the thread that last advanced the holder would wait for itself forever, so it raises
:class:`~bitmtp.errors.BitMTPError` instead. For real concurrency give each caller its own engine
(:meth:`Engine.sibling`, ``BitMTPModel.session()``): engines over one decoder share only read-only
weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from bitmtp.decoding.onepass import DecodeMemory
from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import Decoder
from bitmtp.runtime.decode import DecodeStats, GenerationResult, decode
from bitmtp.runtime.gpu_step import plan_for
from bitmtp.runtime.graphs import GraphPool
from bitmtp.runtime.kv import KVStore, reusable_prefix
from bitmtp.runtime.protocols import StepPool
from bitmtp.runtime.states import ReplayState

#: the runtimes an engine runs its steps on: ``torch`` (``runtime/graphs.py``; CPU, or CUDA graphs on an
#: NVIDIA GPU, through the kernel backends) and ``vulkan`` (``runtime/vulkan``: whole layers on a
#: Vulkan device through WGSL shaders)
RUNTIMES = ("torch", "vulkan")
#: element types of the KV store: the model's float32, or float16 (half the bytes a step's attention reads
#: at depth; the CPU kernels widen it exactly on load, the fused layers store rows rounded to nearest even)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: CUDA graph capture (lazy, inside a step) must not overlap CUDA work of another thread, which
#: torch's default capture mode forbids; engines that capture take this lock for each decode step,
#: so sessions on one GPU interleave their iterations instead of overlapping them.
_CAPTURE_STEP_LOCK = threading.Lock()


#: (what :func:`rows_width_invariant` is told when its caller has not asked for the fused GPU step's plan)
_ASK = object()


def rows_width_invariant(decoder: Decoder, kv: KVStore, gpu_plan: Any = _ASK) -> bool:
    """Whether the KV rows ``decoder`` writes into ``kv`` have bits independent of the step that wrote them (its
    width, the other rows in it): the native CPU layers, unless the fused GPU step (opt-in; its rows' bits depend on
    how rows are grouped into launches) runs the steps. What lets a store's rows be reused by a later prompt.
    ``gpu_plan``: ``plan_for(decoder, kv)`` when the caller has it already (a batched step asks once)."""
    if gpu_plan is _ASK:
        gpu_plan = plan_for(decoder, kv)
    return gpu_plan is None and decoder.device.type == "cpu" and decoder.fused_plan() is not None


class Generation(Iterator[list[int]]):
    """One sequence's decode loop: an iterator of committed token chunks that owns its engine's KV
    store from its first ``next()`` until it is exhausted, raises, is closed (:meth:`close`) or is
    garbage collected. ``StopIteration.value`` is the :class:`GenerationResult`; :attr:`stats` is the
    :class:`DecodeStats`, filled as it runs (also when the caller stops early)."""

    def __init__(self, engine: Engine, input_ids: list[int], kwargs: dict[str, Any]):
        self._engine = engine
        # stats are reported through a box, not through this object: the decode generator must not
        # reference its wrapper, or the pair becomes a cycle that only the cyclic GC frees (and an
        # abandoned generation would hold the store until then)
        self._box: dict[str, Any] = {}
        self._gen = decode(engine, input_ids, report=self._box, **kwargs)
        self._state = "new"  # new → owner → done

    @property
    def stats(self) -> DecodeStats | None:
        return self._box.get("stats")

    @property
    def report(self) -> dict[str, Any]:
        """What the loop reported so far (``runtime.decode.decode``'s ``report``): ``stats``, and after the
        prefill ``output`` (committed tokens, logprobs), ``seed`` and ``prefill_seconds`` — for a caller
        that stops the generation early."""
        return self._box

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> list[int]:
        eng = self._engine
        if self._state == "new":
            eng._acquire()
            self._state = "owner"
        elif self._state == "owner":
            eng._holder = threading.get_ident()  # the thread advancing it now is the one that may not wait on it
        step_lock = _CAPTURE_STEP_LOCK if self._state == "owner" and eng._captures else None
        try:
            if step_lock is None:
                return next(self._gen)
            with step_lock:
                return next(self._gen)
        except BaseException:  # StopIteration (the end) included: the store is free again
            self._release()
            raise

    def close(self) -> None:
        """Stop the generation and release the engine (idempotent)."""
        try:
            self._gen.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self._state == "owner":
            self._state = "done"
            self._engine._release()
        else:
            self._state = "done"

    def __del__(self) -> None:
        # an abandoned generation (a stream dropped half-read) must not keep the store forever
        if getattr(self, "_state", None) == "owner":
            self._state = "done"
            self._engine._release()


class Engine:
    """Owns the KV store and graph pool of one decoder.

    Decoding goes through :meth:`decode`, whose :class:`Generation` owns the store while it runs (see
    the module docstring); :meth:`prefill` / :meth:`ar_step` are the low-level steps (tests,
    benchmarks) and refuse to run while a generation holds the store.

    Args:
        decoder: the model.
        capacity: maximum committed tokens (prompt + generated).
        m_max: widest replay step (2D − 1 for block size D; 16 covers D = 8).
        prefill_chunk: prefill width.
        eager: force eager steps on CUDA (default: ``BITMTP_EAGER``).
        keep_logits: the torch runtime's runners also keep each step's logits (tests).
        runtime: ``"torch"`` (default) or ``"vulkan"`` (:data:`RUNTIMES`); the step pool is that
            runtime's ``runtime.protocols.StepPool``.
        gpu_layers: ``runtime="vulkan"``: layers ``[0, gpu_layers)`` on the device (default all), the rest
            on the CPU (the offload plan's split).
        kv_dtype: the KV store's element type (:data:`KV_DTYPES`; default the model's dtype). float16 K/V
            are rounded once when written; every row's arithmetic still depends on its own inputs only, so
            speculative == AR holds as with float32 K/V (the tokens may differ from float32 K/V's).
    """

    def __init__(self, decoder: Decoder, *, capacity: int = 2048, m_max: int = 16, prefill_chunk: int = 64,
                 eager: bool | None = None, keep_logits: bool = False, runtime: str = "torch",
                 gpu_layers: int | None = None, kv_dtype: torch.dtype | None = None):
        a = decoder.args
        self._config = dict(capacity=capacity, m_max=m_max, prefill_chunk=prefill_chunk, eager=eager,
                            keep_logits=keep_logits, runtime=runtime, gpu_layers=gpu_layers, kv_dtype=kv_dtype)
        kv_dtype = decoder.dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in KV_DTYPES:
            raise BitMTPError(f"kv_dtype: expected one of {', '.join(map(str, KV_DTYPES))} (or None: the model's "
                              f"dtype), got {kv_dtype!r}")
        if runtime == "vulkan" and kv_dtype != decoder.dtype:
            raise BitMTPError(f"kv_dtype: runtime='vulkan' keeps K/V in the model's dtype ({decoder.dtype}); "
                              "drop kv_dtype / kv_type or use runtime='torch'")
        self._lock = threading.Lock()  # held by the Generation that owns the KV store
        self._holder: int | None = None  # the thread that last advanced that generation
        if capacity + m_max > decoder.rope_cos.shape[0]:
            raise BitMTPError(
                f"capacity: {capacity} + {m_max} rows exceed the model's RoPE table "
                f"({decoder.rope_cos.shape[0]} positions); lower capacity"
            )
        self.decoder = decoder
        self.kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, capacity, m_max,
                          dtype=kv_dtype, device=decoder.device)
        if runtime not in RUNTIMES:
            raise BitMTPError(f"runtime: expected one of {', '.join(map(repr, RUNTIMES))}, got {runtime!r}")
        self.runtime = runtime
        self.pool: StepPool
        if runtime == "vulkan":  # whole layers on a Vulkan device, the plan's tail on the CPU
            from bitmtp.runtime.vulkan.device import VulkanStepPool

            self.pool = VulkanStepPool(decoder, self.kv, gpu_layers=gpu_layers)
        else:
            self.pool = GraphPool(decoder, self.kv, eager=eager, keep_logits=keep_logits)
        self._captures = self.pool.capture
        self.prefill_chunk = int(prefill_chunk)
        self.n = 0  # committed tokens whose KV rows [0, n) are materialized (host mirror)
        self.syncs = 0  # device→host reads (tests count them)
        self.last_stats = None  # the DecodeStats of the latest decode() (filled as it runs)
        #: what policies learn across this engine's generations (auto's running acceptance estimates, the
        #: step costs); only the generation that owns the store touches it
        self.memory = DecodeMemory()
        #: the prompt-prefix cache: tokens whose KV rows [0, len) the store holds with the bits a fresh prefill
        #: gives them (:meth:`resume`), and how many of them a fresh prefill's whole chunks computed (what a
        #: step whose rows depend on its width may reuse)
        self._kept: list[int] = []
        self._kept_chunks = 0
        # static helpers of the decode loop, allocated once (no allocation in the loop)
        self.arange = torch.arange(max(m_max, prefill_chunk) + 1, device=decoder.device)
        self._staging = torch.zeros(4 * (m_max + 1), dtype=torch.float64, device=decoder.device)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def sibling(self) -> Engine:
        """A new engine over the same decoder with the same settings: its own KV store and graph pool,
        so it decodes concurrently with this one (the decoder's weights are only read by a step)."""
        return Engine(self.decoder, **self._config)

    @property
    def busy(self) -> bool:
        """Whether a generation holds the KV store right now."""
        return self._lock.locked()

    def _acquire(self) -> None:
        """Take the store for a generation: wait for a generation advanced by another thread; raise
        for one advanced by this thread (waiting would deadlock: only this thread can finish it)."""
        me = threading.get_ident()
        if not self._lock.acquire(blocking=False):
            if self._holder == me:
                raise BitMTPError(
                    "generate: a stream on this model is still open in this thread and owns its KV store; "
                    "exhaust it or call its close() (or use `with generate(..., stream=True) as s:`) before "
                    "starting another generation, or decode concurrently on model.session()")
            self._lock.acquire()
        self._holder = me

    def _release(self) -> None:
        self._holder = None
        self._lock.release()

    def _check_free(self, what: str) -> None:
        if self._lock.locked():
            raise BitMTPError(f"{what}: a generation owns this engine's KV store; finish or close it first "
                              "(or step a separate Engine / model.session())")

    def calibrate(self, *, rebuild: bool = False, progress: bool = False) -> Any:
        """The step-cost table ``policy="auto"`` plans with (``runtime.calibration.load_cost_table``): cached
        or memoised, else measured now (~5 s on 2 CPU cores), so that no generation pays the measurement.
        Takes the KV store like a generation (the measurement overwrites its rows): waits for one that another
        thread runs, refuses one this thread holds open."""
        from bitmtp.runtime.calibration import load_cost_table

        self._acquire()
        try:
            return load_cost_table(self, rebuild=rebuild, progress=progress)
        finally:
            self._release()

    def reset(self) -> None:
        """Forget the sequence (rows are overwritten by the next prefill; nothing is cleared or copied), and the
        prefix cache with it (low-level steps may write any row from here on)."""
        self.n = 0
        self._forget_prefix()

    def _forget_prefix(self) -> None:
        self._kept, self._kept_chunks = [], 0

    @property
    def rows_width_invariant(self) -> bool:
        """Whether a KV row's bits are independent of the width of the step that wrote it: the native CPU layers
        (``docs/kernels.md``: integer-exact linears, the attention's fixed chunks), not the fused GPU step (its
        rows' bits depend on how rows are grouped into launches). Then every row a generation
        wrote equals a fresh prefill's and may be reused; else only whole prefill chunks at the same offsets."""
        return rows_width_invariant(self.decoder, self.kv) and self.runtime == "torch"

    def resume(self, ids: list[int]) -> int:
        """Start a sequence ``ids``, reusing the KV rows of its longest prefix the store still holds from the
        previous generation (the prompt-prefix cache): sets :attr:`n` to that many rows and returns it. The rows
        reused have exactly the bits a fresh prefill would give them, so every output is the one a fresh engine
        gives: with width-invariant rows (:attr:`rows_width_invariant`) any prefix of the previous prompt and
        the tokens generated after it, else only whole prefill chunks of the previous prompt (the same
        computation at the same offsets). The prompt's last row always runs (its choice is the first token);
        the Vulkan runtime reuses nothing."""
        common = reusable_prefix(ids, self._kept) if self.runtime == "torch" else 0
        if not self.rows_width_invariant:
            common = min(common, self._kept_chunks) // self.prefill_chunk * self.prefill_chunk
        self.n = common
        self._forget_prefix()  # until the prefill has written the new rows
        return common

    def keep(self, tokens: list[int], prompt: int) -> None:
        """After a prefill of ``tokens[:prompt]`` (or a generation whose KV rows [0, len(tokens)) hold
        ``tokens``): what :meth:`resume` may reuse next (without width-invariant rows, only the prompt's whole
        prefill chunks)."""
        self._kept = list(tokens)
        self._kept_chunks = prompt // self.prefill_chunk * self.prefill_chunk

    def _step(self, role: str, tokens: torch.Tensor | int, start: int):
        """Fill the static inputs of the state's runner in place (an int fills a width-1 step without
        building a host tensor) and run it."""
        m = 1 if isinstance(tokens, int) else tokens.numel()
        state = ReplayState(m, self.kv.segment_for(start + m), role)
        runner = self.pool.get(state)
        runner.feed(tokens, start)
        runner.run()
        return runner

    def prefill(self, ids: Iterable[int]) -> int:
        """Materialize the KV of ``ids`` from position ``self.n`` on; return the argmax after the last one."""
        self._check_free("prefill")
        self._forget_prefix()
        return self._prefill(ids)

    def _prefill(self, ids: Iterable[int], with_prob: bool = False) -> int | tuple[int, float]:
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
        if with_prob:  # the chosen token's probability too, in the same read
            last, prob = self.read(runner.out_token[-1:], runner.out_prob[-1:])
            return last[0], prob[0]
        (last,) = self.read(runner.out_token[-1:])  # the one device→host read of the prefill
        return last[0]

    def ar_step(self, token: int) -> int:
        """Feed one committed token at position ``n`` (its KV is written, n += 1); return the next argmax."""
        self._check_free("ar_step")
        self._forget_prefix()
        return self._ar_step(token)

    def _ar_step(self, token: int, with_prob: bool = False) -> int | tuple[int, float]:
        if self.n >= self.capacity:
            raise BitMTPError(f"capacity: the KV store is full ({self.capacity} tokens)")
        runner = self._step("ar", int(token), self.n)
        self.n += 1
        if with_prob:
            tok, prob = self.read(runner.out_token[:1], runner.out_prob[:1])
            return tok[0], prob[0]
        (tok,) = self.read(runner.out_token[:1])  # the one device→host sync of this step
        return tok[0]

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Bring small device tensors to the host in ONE transfer (the instrumented sync point).

        The tensors are gathered into a float64 staging buffer on the device (token ids < 2^53 are
        exact in float64) and read with a single ``tolist``; integer tensors come back as ints. The
        pool's ``flush`` runs first: a pool that keeps outputs on another device (Vulkan) brings them
        all over in one read; the torch pool's does nothing.
        """
        self.pool.flush()
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

    def decode(self, input_ids: Iterable[int], **kwargs) -> Generation:
        """The decode loop (see ``runtime/decode.py``) as a :class:`Generation` of committed token chunks;
        its return value (``StopIteration.value``) is the :class:`GenerationResult`. It owns the KV
        store from its first ``next()`` until it ends or is closed (module docstring)."""
        return Generation(self, list(input_ids), kwargs)

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
