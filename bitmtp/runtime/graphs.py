"""The graph pool: one static-buffer step runner per replay state.

A runner owns static inputs (tokens, positions, n) and static outputs (per-row argmax token and
its probability; logits only when asked for). On CUDA it is captured lazily into a
``torch.cuda.CUDAGraph`` (warm-up on a side stream, one memory pool shared by all graphs) and
replayed; elsewhere — or with ``BITMTP_EAGER=1`` — the same body runs eagerly. Either way the
caller's protocol is identical: fill inputs, ``run()``, read outputs. :class:`GraphPool` and
:class:`StepRunner` are the torch runtime's ``runtime.protocols.StepPool`` / ``StepRunner`` (the
Vulkan runtime's are in ``runtime/vulkan/device.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from bitmtp.decoding.sampling import Sampler, SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import GPU_STEP, Decoder, StepInputs
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.step_inputs import StepInputsFill
from bitmtp.ops.threads import step_threads
from bitmtp.runtime.gpu_step import ROWS, GpuStepPlan, Launcher, plan_for
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.states import DRAFT_ROLES, ReplayState

#: mask_fn(state, positions [M], kv_index [L]) -> bool mask [M, L]
MaskFn = Callable[[ReplayState, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftBody(Protocol):
    """What the graph pool needs of a drafter: the body of a draft step (``bitmtp.decoding.drafters``)."""

    def draft(self, runner: StepRunner) -> None:
        """Run the draft step of ``runner.state`` (p pending rows, block D) from its static inputs and
        write d_1..d_D and their probabilities into ``runner.out_token[-D:]`` / ``runner.out_prob[-D:]``."""


def causal_mask(state: ReplayState, positions: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """AR-causal: row i sees KV rows j ≤ position_i (prefill, ar and verify roles)."""
    return kv_index[None, :] <= positions[:, None]


def eager_forced() -> bool:
    return os.environ.get("BITMTP_EAGER", "") == "1"


class HostCausal:
    """A CPU runner's causal mask and RoPE rows, computed by numpy from its own positions buffer (a numpy-backed
    tensor, whoever filled it) into buffers made once: a step's host glue is mostly its torch calls, 10-90 µs
    each with the caches cold after the layers against 1-20 µs for a numpy call (``bench/glue.py``); the torch
    mask and RoPE lookups were five of them."""

    def __init__(self, ints: np.ndarray, segment: int, head_dim: int):
        m = ints.shape[1]
        self.ints, self.pos = ints, ints[1]  # [tokens, positions]: the runner's input tensors' memory
        self._mask = np.zeros((m, segment), dtype=np.bool_)
        self._rope = np.zeros((2, m, head_dim), dtype=np.float32)
        self.mask = torch.from_numpy(self._mask)
        self.rope = (torch.from_numpy(self._rope[0]), torch.from_numpy(self._rope[1]))
        # row i sees KV rows [0, its position]: one native call a step (ops.step_inputs)
        self._fill = StepInputsFill(self.pos, None, self.pos, self._mask, self._rope[0], self._rope[1])

    def inputs(self, tables: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The mask (row i sees KV rows j <= its position) and the rows' RoPE ``(cos, sin)`` from the decoder's
        ``tables`` (``Decoder.rope_host``)."""
        self._fill(tables)
        return self.mask, self.rope


class StepRunner:
    """The torch runtime's step runner (``runtime.protocols.StepRunner``): a decoder step, a draft body,
    eager or as a captured CUDA graph."""

    def __init__(self, decoder: Decoder, kv: KVStore, state: ReplayState, mask_fn: MaskFn | None,
                 *, keep_logits: bool = False, capture: bool = False, mempool=None,
                 drafter: DraftBody | None = None, sampler: Sampler | None = None):
        dev = decoder.device
        m = state.width
        self.decoder, self.kv, self.state, self.mask_fn = decoder, kv, state, mask_fn
        self.drafter = drafter
        #: how rows choose their token (None: argmax; ``bitmtp.decoding.sampling``), fixed for the runner's
        #: life: the pool drops its runners when the sampling program changes
        self.sampler = sampler
        #: a verify step's first input token not yet committed: 0 for a two-pass verify (all of d_1..d_D
        #: are new), 1 when row 0 is the committed pending token (one pass); a device tensor, so a captured
        #: graph reads the loop's current value (only penalties read it)
        self.fresh_from = torch.ones((), dtype=torch.long, device=dev)
        self.tokens = torch.zeros(m, dtype=torch.long, device=dev)
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)
        #: on the CPU with float32 RoPE tables, the causal mask and RoPE rows by numpy (:class:`HostCausal`)
        self.host: HostCausal | None = None
        if dev.type == "cpu" and decoder.rope_host() is not None:
            ints = np.zeros((2, m), dtype=np.int64)
            self.tokens, self.positions = torch.from_numpy(ints[0]), torch.from_numpy(ints[1])
            self.host = HostCausal(ints, state.segment, decoder.args.head_dim)
        #: KV slot of each row (the tree role: rows that share a position write to scratch slots)
        self.slots = torch.zeros(m, dtype=torch.long, device=dev)
        self.out_token = torch.zeros(m, dtype=torch.long, device=dev)
        self.out_prob = torch.zeros(m, dtype=torch.float32, device=dev)
        #: a fused step's first mask row's second choice (the ``top2`` schedule's runner-up for the next g_1)
        self.out_second = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(m, decoder.args.vocab_size, dtype=torch.float32, device=dev) if keep_logits else None
        self.kv_index = torch.arange(state.segment, device=dev)
        self.capture = capture
        self.mempool = mempool
        self.graph = None
        self.replays = 0
        #: counts the kernels the fused GPU step launches (``bitmtp.runtime.gpu_step``)
        self.launcher = Launcher()

    def feed(self, tokens: torch.Tensor | int, start: int) -> None:
        """``runtime.protocols.StepRunner.feed``: by numpy on the CPU (no torch call: ``HostCausal``)."""
        m = self.state.width
        if self.host is not None:
            ints = self.host.ints
            if isinstance(tokens, int):
                ints[0] = tokens
            else:
                self.tokens.copy_(tokens)  # (a prompt chunk's: once a chunk, not a decode step)
            ints[1] = range(start, start + m) if m > 1 else start
            return
        if isinstance(tokens, int):
            self.tokens.fill_(tokens)
        else:
            self.tokens.copy_(tokens, non_blocking=True)
        torch.arange(start, start + m, out=self.positions)

    @torch.no_grad()
    def _body(self) -> None:
        plan = self._gpu_step()
        if plan is not None:  # the whole step in the fused GPU kernels (bitmtp.runtime.gpu_step)
            self._fused_body(plan)
            self.decoder._took(GPU_STEP, "")
            return
        if self.drafter is not None:
            self.drafter.draft(self)
            return
        tables = self.decoder.rope_host() if self.host is not None and self.mask_fn is causal_mask else None
        if tables is not None:
            mask, rope = self.host.inputs(tables)
        else:
            mask, rope = self.mask_fn(self.state, self.positions, self.kv_index), None
        step = StepInputs(self.tokens, self.positions, mask, rope=rope)
        if self.sampler is None and self.logits is None:
            # the layers, the final norm, the LM head and the argmax in one native call on the CPU, into the static
            # outputs (three ops after the layers cost ~100 µs of glue, the call between them more: bench/glue.py)
            self.decoder.choose_step(step, self.kv, out=(self.out_token, self.out_prob))
            return
        self._take(self.decoder(step, self.kv))

    def _take(self, logits: torch.Tensor) -> None:
        """A decode / verify / prefill step's choice from its rows' logits: argmax or the sampler."""
        if self.sampler is None:
            # straight into the static outputs (no temporaries, no copies: bench/glue.py)
            tok, prob = argmax_prob(logits, out=(self.out_token, self.out_prob))
        else:
            # prefill rows' history is the prompt, counted already; ar and verify rows are AR-causal over
            # this step's tokens (the guesses among them count as the history of the rows after them)
            ar_rows = 0 if self.state.role == "prefill" else self.state.width
            tok, prob = self.sampler.select(logits, self.positions, self.tokens, ar_rows, self.fresh_from)
        if tok is not self.out_token:
            self.out_token.copy_(tok)
            self.out_prob.copy_(prob)
        if self.logits is not None and logits.data_ptr() != self.logits.data_ptr():
            self.logits.copy_(logits)

    def _fused_body(self, plan: GpuStepPlan) -> None:
        """The step through ``plan``: a mask-block drafter's rows take its layout (mask rows, the tree's and the
        top2 runner-up's KV slots); argmax steps choose inside the head's kernels, sampled steps and steps that
        keep logits from the head's logits (the layers stay fused either way)."""
        st, m = self.state, self.state.width
        mask_rows, block, slots = 0, None, self.positions
        if self.drafter is not None:
            mask, drafter_slots, mask_rows = self.drafter.layout(self)
            block = self.drafter.block
            slots = self.positions if drafter_slots is None else drafter_slots
        else:
            mask = self.mask_fn(st, self.positions, self.kv_index)
        logits = None
        if self.sampler is not None or self.logits is not None:
            logits = self.logits if self.logits is not None else plan.logits_rows(m)
        plan.step(self.launcher, self.tokens, self.positions, slots, mask, self.out_token if logits is None else None,
                  self.out_prob, m=m, mask_rows=mask_rows, block=block, logits=logits)
        if logits is None:
            if st.role == "fused":  # the first mask row's runner-up, from the head's kernels
                self.out_second.copy_(plan.seconds[st.pending + st.alt : st.pending + st.alt + 1])
        elif self.drafter is not None:
            self.drafter.take(self, logits[self.drafter.first_output_row(self) : m])
        else:
            self._take(logits[:m])

    def _gpu_step(self) -> GpuStepPlan | None:
        """The fused GPU step's plan when it covers this runner's steps, else None (the reason, when the step is
        what is not covered, in ``decoder.gpu_step_reason``)."""
        plan = plan_for(self.decoder, self.kv)
        if plan is None:
            return None
        st = self.state
        kind = self.drafter.kind if self.drafter is not None else ""
        why = ""
        if st.width > ROWS:
            why = f"a {st.width}-row step (the fused kernels take up to {ROWS})"
        elif self.drafter is not None and kind != "mask-block":
            why = f"the {kind} drafter's step"
        elif st.alt:
            # the runner-up row's KV sits in a scratch slot: the CPU attention sums it in the lane of its own
            # position (onepass.runner_up_slot), the fused split-KV attention in another block order
            why = "the top2 schedule's runner-up row (its bits equal AR's only in the per-op attention)"
        if why:
            self.decoder.gpu_step_reason = why + " runs per op"
            return None
        return plan

    def run(self) -> None:
        if not self.capture:
            with step_threads(self.decoder.device):  # torch's own ops inline, kernels on the extension's team
                self._body()
            return
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: the step's KV writes are idempotent
                    self._body()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.mempool):
                self._body()
        self.graph.replay()
        self.replays += 1


class GraphPool:
    """Maps a :class:`ReplayState` to its runner, creating (and on CUDA capturing) it on first use
    (``runtime.protocols.StepPool``)."""

    def __init__(self, decoder: Decoder, kv: KVStore, *, eager: bool | None = None, keep_logits: bool = False):
        self.decoder, self.kv = decoder, kv
        self.keep_logits = keep_logits
        cuda = decoder.device.type == "cuda"
        self.capture = cuda and not (eager if eager is not None else eager_forced())
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.runners: dict[ReplayState, StepRunner] = {}
        self.mask_fns: dict[str, MaskFn] = {"prefill": causal_mask, "ar": causal_mask, "verify": causal_mask}
        self.drafter: DraftBody | None = None
        self.sampler: Sampler | None = None
        self.fused_steps = True

    def set_drafter(self, drafter: DraftBody | None) -> None:
        """Use ``drafter`` for draft states; runners (and graphs) of another drafter are dropped."""
        if drafter is not self.drafter:
            self.runners = {s: r for s, r in self.runners.items() if s.role not in DRAFT_ROLES}
            self.drafter = drafter

    def set_sampling(self, params: SamplingParams | None) -> Sampler | None:
        """Choose tokens by ``params`` from now on (None or greedy: the argmax path); returns the pool's
        :class:`~bitmtp.decoding.sampling.Sampler` (None when greedy). Runners bake the sampling program
        in (a captured graph especially), so a different program drops them all; the seed and the counts
        live in the sampler's tensors and change without recapture."""
        program = None if params is None or params.greedy else params.program()
        current = self.sampler.params if self.sampler is not None else None
        if program != current:
            self.runners = {}
            self.sampler = (Sampler(program, self.decoder.args.vocab_size, self.decoder.device)
                            if program is not None else None)
        return self.sampler

    @staticmethod
    def check_sampling(params: SamplingParams | None) -> None:
        """Every sampling program runs here (``runtime.protocols.StepPool.check_sampling``)."""

    def get(self, state: ReplayState) -> StepRunner:
        runner = self.runners.get(state)
        if runner is None:
            capture = self.capture and state.role != "prefill"  # prefill runs once per prompt: eager
            if state.role in DRAFT_ROLES:
                if self.drafter is None:
                    raise BitMTPError("draft step: no drafter is set (load an adapter or pass a drafter)")
                runner = StepRunner(self.decoder, self.kv, state, None, capture=capture, mempool=self.mempool,
                                    drafter=self.drafter, sampler=self.sampler)
            else:
                runner = StepRunner(self.decoder, self.kv, state, self.mask_fns[state.role],
                                    keep_logits=self.keep_logits, capture=capture, mempool=self.mempool,
                                    sampler=self.sampler)
            self.runners[state] = runner
        return runner

    def flush(self) -> None:
        """Nothing to bring over: the runners' outputs are torch tensors ``Engine.read`` reads directly
        (``runtime.protocols.StepPool.flush``)."""
