"""The Vulkan runtime's device model, step pool and step runners: whole layers on a wgpu device.

:class:`VulkanStepPool` is the step pool of ``runtime="vulkan"`` (``bitmtp.load``), beside the torch
runtime's ``runtime.graphs.GraphPool``; both implement ``runtime.protocols.StepPool``. Its runners
keep the host protocol (``runtime.protocols.StepRunner``: fill ``tokens`` / ``positions``, ``run()``,
read ``out_token`` / ``out_prob``), but a step runs on the device — embedding gather, every device
layer as the model's layer spec says (``decoder.args.layer_spec``: its norms by slot, its
activation's shader; the mask block's gated LoRA on mask rows), the final norm, the LM head and the
argmax — and its outputs stay there until the engine reads. ``flush`` brings every pending runner's
outputs back in ONE read; the verify preparation and resolution of the decode loop run on the device
too (``step.wgsl``; the ``runtime.protocols.DeviceVerifyRunner`` capability), so a decode iteration
costs one readback, as on CUDA. The ops are ``bitmtp.wgsl_fallback.ops`` (the WGSL kernels layer).

A model whose layer spec has an activation or a norm slot this module does not implement
(:data:`VULKAN_ACTIVATIONS`, :data:`VULKAN_NORMS`) is refused when the pool is made, with
``bitmtp.model.families.UnsupportedLayer``.

A step's commands depend only on its replay state (widths, segment, role, drafter), so a runner whose
body encoded the same commands twice in a row — same pipelines, bind groups (its arena's buffers),
grids, copies and uniform contents (``Runner.record``) — replays that recording from then on instead
of running the Python that built it (``Runner.replay``): ~5 µs per dispatch instead of ~80 µs, the wgpu
counterpart of CUDA-graph replay. ``BITMTP_EAGER=1`` turns it off; a step that reads or writes host
memory in its body (the CPU-offloaded tail) is never replayed.

Layers the offload plan (``runtime.vulkan.planner``) puts on the CPU run through the decoder's own torch
modules (the csrc/cpu kernels) with their KV in the engine's host ``KVStore``: the step's M hidden
rows cross to the host and back, and such steps read back at once (the host needs its rows).
"""

from __future__ import annotations

import numpy as np
import torch

from bitmtp.decoding.drafters import HeadsDrafter, MaskBlockDrafter
from bitmtp.errors import BitMTPError
from bitmtp.formats.ggml_blocks import HALF_FORMATS, BlockWeight
from bitmtp.model.decoder import Decoder, StepInputs
from bitmtp.model.families import Activation, Norm
from bitmtp.model.fuse import Stacked
from bitmtp.model.layers import DenseLinear
from bitmtp.ops import TernaryLinear
from bitmtp.runtime.graphs import eager_forced
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.states import ReplayState
from bitmtp.wgsl_fallback.ops import DenseWeight, Ops, TernaryWeight
from bitmtp.wgsl_fallback.runner import DeviceTensor, Recording, Runner

#: the activations this runtime implements → their shader in ``elementwise.wgsl`` (``Ops.gated``)
VULKAN_ACTIVATIONS: dict[Activation, str] = {Activation.SILU: "silu", Activation.RELU2: "relu2"}
#: the norm slots it implements: each one an ``rms_norm`` dispatch over the slot's rows
VULKAN_NORMS: tuple[Norm, ...] = tuple(Norm)
#: how this runtime names itself in errors
EXECUTOR = "the Vulkan runtime (runtime='vulkan')"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def _half_rows(bw: BlockWeight | None) -> torch.Tensor | None:
    """A ``bf16`` / ``f16`` block weight's own 16-bit values as a ``[N, K]`` tensor (a view), else None."""
    if bw is None or bw.fmt not in HALF_FORMATS:
        return None
    return bw.data.view(HALF_FORMATS[bw.fmt]).view(bw.shape)


def _dense_source(module: DenseLinear) -> torch.Tensor:
    """What a dense projection uploads: half rows as they are (exact, half the bytes, and no float32 copy is
    made on the host), else the float weight."""
    half = _half_rows(module.blocks)
    return half if half is not None else module.weight


class _Proj:
    """A projection on the device: ternary (T2 words + scales) or dense float32, plus bias."""

    def __init__(self, ops: Ops, module, name: str):
        r = ops.r
        if isinstance(module, Stacked):
            raise BitMTPError(f"{name}: the Vulkan runtime runs fused projections of one kind; this one mixes "
                              "ternary and dense parts")
        self.bias = None if module.bias is None else r.upload(_np(module.bias))
        if isinstance(module, TernaryLinear):
            scales = module.scales.detach().float().cpu().numpy()
            group = module.group_size if module.scales.shape[1] > 1 else None
            self.weight = TernaryWeight.upload(r, module.weight.cpu().numpy(), scales, module.in_features, group)
            self.ternary = True
        elif isinstance(module, DenseLinear):  # bf16 / f16 weights stay 16-bit on the device
            self.weight = DenseWeight.upload(r, _dense_source(module))
            self.ternary = False
        else:
            raise BitMTPError(f"{name}: the Vulkan runtime cannot run a {type(module).__name__}")
        self.out_features = module.out_features

    def __call__(self, ops: Ops, x: DeviceTensor) -> DeviceTensor:
        if self.ternary:
            return ops.ternary_linear(x, self.weight, self.bias)
        return ops.dense(x, self.weight, self.bias)


class _Layer:
    """One decoder layer's device copy: its projections and its norms by slot."""

    def __init__(self, ops: Ops, layer, i: int):
        r = ops.r
        at, mlp = layer.attn, layer.mlp
        self.qkv = _Proj(ops, at.qkv_proj, f"layers.{i}.qkv")
        self.o = _Proj(ops, at.o_proj, f"layers.{i}.o")
        self.gate_up = _Proj(ops, mlp.gate_up_proj, f"layers.{i}.gate_up")
        self.down = _Proj(ops, mlp.down_proj, f"layers.{i}.down")
        self.norms: dict[Norm, DeviceTensor] = {}
        for slot in Norm:
            weight = layer.norm(slot)
            if weight is not None:
                self.norms[slot] = r.upload(_np(weight))

    def norm(self, slot: Norm) -> DeviceTensor | None:
        """The device weight of norm ``slot``, or None when the layer has no such norm."""
        return self.norms.get(slot)


class DeviceModel:
    """The decoder's device-resident part: layers ``[0, gpu_layers)``, final norm, LM head, embeddings
    (the LM head's buffer when tied), RoPE tables and the device layers' KV caches."""

    def __init__(self, decoder: Decoder, kv: KVStore, runner: Runner, gpu_layers: int):
        a = decoder.args
        spec = a.layer_spec
        spec.check(EXECUTOR, VULKAN_ACTIVATIONS, VULKAN_NORMS)  # UnsupportedLayer before any upload
        self.activation = VULKAN_ACTIVATIONS[spec.activation]
        self.decoder, self.args, self.kv = decoder, a, kv
        self.r, self.ops = runner, Ops(runner)
        self.gpu_layers = int(gpu_layers)
        self.layers = [_Layer(self.ops, decoder.layers[i], i) for i in range(self.gpu_layers)]
        self.norm = runner.upload(_np(decoder.norm))
        self.lm_head = _Proj(self.ops, decoder.lm_head, "lm_head")
        if a.tie_word_embeddings:
            self.embed = self.lm_head.weight  # one device copy serves the gather and the LM head
        else:
            half = _half_rows(decoder.embed_blocks)
            self.embed = DenseWeight.upload(runner, decoder.embed if half is None else half)
        self.cos, self.sin = runner.upload(_np(decoder.rope_cos)), runner.upload(_np(decoder.rope_sin))
        rows = kv.capacity + kv.m_max
        shape = (a.num_kv_heads, rows, a.head_dim)
        self.kc = [runner.empty(shape) for _ in range(self.gpu_layers)]
        self.vc = [runner.empty(shape) for _ in range(self.gpu_layers)]
        self.scale = a.head_dim ** -0.5
        self.lora: dict[tuple[int, str], tuple[DeviceTensor, DeviceTensor]] = {}
        self.mask_embedding: DeviceTensor | None = None
        self.heads = None

    # ---- adapters ------------------------------------------------------------------------------------

    def set_mask_block(self, block) -> None:
        """Upload a ``MaskBlock``'s mask embedding and fused LoRA factors (B scaled by α/r once)."""
        r = self.r
        self.mask_embedding = r.upload(_np(block.mask_embedding).reshape(1, -1))
        self.lora = {}
        for (i, group), a in block.a.items():
            if i < self.gpu_layers:
                b = block.b[(i, group)] * block.scaling
                self.lora[(i, group)] = (r.upload(_np(a)), r.upload(_np(b)))

    def set_heads(self, heads) -> None:
        """Upload ``DraftHeads`` with each head's down projection split into its state and embedding halves
        (``W_down·[s ‖ e] = W_s·s + W_e·e``: no concatenation on the device)."""
        h = self.args.hidden_size
        self.heads = [(self.r.upload(_np(heads.down[k][:, :h])), self.r.upload(_np(heads.down[k][:, h:])),
                       self.r.upload(_np(heads.up[k])), self.r.upload(_np(heads.norm[k])))
                      for k in range(heads.down.shape[0])]
        self.heads_eps = heads.eps

    def heads_step(self, k: int, state: DeviceTensor, token_embedding: DeviceTensor) -> DeviceTensor:
        """Head ``k`` on the device: ``s_k = RMSNorm(W_up·(W_s·s_(k−1) + W_e·e) + s_(k−1))``, the device
        form of ``bitmtp.model.adapters.DraftHeads.step`` (W_down split into its state and embedding halves)."""
        ops = self.ops
        w_s, w_e, up, norm = self.heads[k]
        z = ops.add(ops.dense(state, w_s), ops.dense(token_embedding, w_e))
        return ops.rms_norm(ops.add(ops.dense(z, up), state), norm, self.heads_eps)

    # ---- one step --------------------------------------------------------------------------------------

    def _lora(self, i: int, group: str, inputs: DeviceTensor, outputs: DeviceTensor, first: int) -> None:
        factors = self.lora.get((i, group))
        if factors is None or first >= inputs.shape[0]:
            return
        a, b = factors
        rows = self.ops.slice_rows(inputs, first, inputs.shape[0])
        delta = self.ops.dense(self.ops.dense(rows, a), b)
        self.ops.add_into(outputs, delta, first)

    def layer(self, i: int, x: DeviceTensor, positions: DeviceTensor, mask: DeviceTensor,
              mask_rows: int) -> DeviceTensor:
        """Decoder layer ``i`` on the step's rows ``x``: the same sequence of ops, norm slots and gated-LoRA
        points as the reference executor ``Decoder.run_layers``."""
        a, ops, lay = self.args, self.ops, self.layers[i]
        m = x.shape[0]
        first = m - mask_rows
        eps = a.rms_norm_eps
        h = ops.rms_norm(x, lay.norm(Norm.ATTN_IN), eps)
        qkv = lay.qkv(ops, h)
        if mask_rows:
            self._lora(i, "qkv", h, qkv, first)
        q = ops.view(ops.cols(qkv, 0, a.q_size), (m, a.num_heads, a.head_dim))
        k = ops.view(ops.cols(qkv, a.q_size, a.kv_size), (m, a.num_kv_heads, a.head_dim))
        v = ops.view(ops.cols(qkv, a.q_size + a.kv_size, a.kv_size), (m, a.num_kv_heads, a.head_dim))
        if lay.norm(Norm.Q) is not None:
            q = ops.rms_norm(q, lay.norm(Norm.Q), eps, a.head_dim)
        if lay.norm(Norm.K) is not None:
            k = ops.rms_norm(k, lay.norm(Norm.K), eps, a.head_dim)
        ops.rope_(q, self.cos, self.sin, positions)
        ops.rope_(k, self.cos, self.sin, positions)
        ops.kv_write(k, self.kc[i], positions)
        ops.kv_write(v, self.vc[i], positions)
        att = ops.view(ops.attention(q, self.kc[i], self.vc[i], mask, self.scale), (m, a.q_size))
        if lay.norm(Norm.ATTN_SUB) is not None:
            att = ops.rms_norm(att, lay.norm(Norm.ATTN_SUB), eps)
        o = lay.o(ops, att)
        if mask_rows:
            self._lora(i, "o", att, o, first)
        x = ops.add(x, o)
        h = ops.rms_norm(x, lay.norm(Norm.MLP_IN), eps)
        gu = lay.gate_up(ops, h)
        if mask_rows:
            self._lora(i, "gate_up", h, gu, first)
        act = ops.gated(gu, self.activation)
        if lay.norm(Norm.MLP_SUB) is not None:
            act = ops.rms_norm(act, lay.norm(Norm.MLP_SUB), eps)
        dn = lay.down(ops, act)
        if mask_rows:
            self._lora(i, "down", act, dn, first)
        if lay.norm(Norm.MLP_OUT) is not None:
            dn = ops.rms_norm(dn, lay.norm(Norm.MLP_OUT), eps)
        return ops.add(x, dn)

    def hidden(self, runner: VulkanStepRunner, mask_rows: int) -> DeviceTensor:
        """Final normed hidden states ``[M, hidden]`` of the runner's rows (device layers, then the CPU
        tail through the decoder's torch modules)."""
        ops, st = self.ops, runner.state
        m = st.width
        p = m - mask_rows
        x = self.r.empty((m, self.args.hidden_size))
        ops.gather(self.embed, runner.dev_tokens, count=p, out=x)
        if mask_rows:
            for j in range(p, m):
                ops.copy_rows(self.mask_embedding, x, j)
        mask = ops.mask(runner.dev_positions, st.segment, p, out=runner.dev_mask)
        for i in range(self.gpu_layers):
            x = self.layer(i, x, runner.dev_positions, mask, mask_rows)
        if self.gpu_layers < self.args.num_layers:
            x = self._cpu_tail(runner, x, mask_rows)
        return ops.rms_norm(x, self.norm, self.args.rms_norm_eps)

    def _cpu_tail(self, runner: VulkanStepRunner, x: DeviceTensor, mask_rows: int) -> DeviceTensor:
        """Layers ``[gpu_layers, L)`` on the host: the step's rows cross over and back (a read)."""
        dec = self.decoder
        m = x.shape[0]
        p = m - mask_rows
        host = torch.from_numpy(self.r.read(x)).to(dec.dtype)
        pos = runner.positions
        reach = torch.where(torch.arange(m) < p, pos, pos[-1])
        mask = runner.kv_index[None, :] <= reach[:, None]
        block = runner.pool.mask_block if mask_rows else None
        step = StepInputs(runner.tokens, pos, mask, mask_rows=mask_rows, mask_block=block)
        with torch.no_grad():
            host = dec.run_layers(host, step, self.kv, range(self.gpu_layers, self.args.num_layers))
        return self.r.upload(_np(host))

    def logits_argmax(self, hidden: DeviceTensor, out: DeviceTensor, offset: int) -> None:
        """LM head over ``hidden`` rows and their argmax/probability into ``out`` at ``offset``."""
        self.ops.argmax(self.lm_head(self.ops, hidden), out, offset)


class VulkanStepRunner:
    """A step runner whose body runs on the Vulkan device (see the module docstring); implements
    ``runtime.protocols.StepRunner`` and ``DeviceVerifyRunner``."""

    def __init__(self, pool: VulkanStepPool, state: ReplayState):
        m = state.width
        self.pool, self.state = pool, state
        r = pool.model.r
        self.tokens = torch.zeros(m, dtype=torch.long)
        self.positions = torch.zeros(m, dtype=torch.long)
        self.out_token = torch.zeros(m, dtype=torch.long)
        self.out_prob = torch.zeros(m, dtype=torch.float32)
        self.kv_index = torch.arange(state.segment)
        self.dev_tokens, self.dev_positions = r.empty((m,), "u32"), r.empty((m,), "u32")
        self.dev_out = r.empty((2 * m,), "u32")
        self.dev_mask = r.empty((m, state.segment), "u32")
        self.device_fed = False  # inputs written on the device (prepare/resolve): do not upload the host's
        self.replays = 0  # steps run
        self.replayed = 0  # of those, re-encoded from the captured recording
        self.captured: Recording | None = None  # the body's commands, once two recordings agreed
        self._last: Recording | None = None
        self._capturable = not eager_forced()

    def feed(self, tokens: torch.Tensor | int, start: int) -> None:
        """``runtime.protocols.StepRunner.feed``."""
        if isinstance(tokens, int):
            self.tokens.fill_(tokens)
        else:
            self.tokens.copy_(tokens)
        torch.arange(start, start + self.state.width, out=self.positions)

    @property
    def device_verify(self) -> bool:
        """The verify bookkeeping runs on the device unless the pool has CPU-offloaded layers."""
        return self.pool.device_verify

    def run(self) -> None:
        model, r = self.pool.model, self.pool.model.r
        # the state's arena: its intermediates, uniforms and bind groups are reused step after step
        with r.arena(self.state, user=self) as same_user:
            if not same_user:  # another runner of this state (another model) rewrote the arena's uniforms
                self.captured = self._last = None
            if not self.device_fed:
                r.write(self.dev_tokens, self.tokens.numpy().astype(np.uint32))
                r.write(self.dev_positions, self.positions.numpy().astype(np.uint32))
            self.device_fed = False
            if self.captured is not None:
                r.replay(self.captured)
                self.replayed += 1
            elif self._capturable:
                with r.record() as rec:
                    self._body(model)
                self._note(rec)
            else:
                self._body(model)
        self.replays += 1
        self.pool.pending.append(self)
        if self.pool.sync_each_step:  # offloaded layers: the host needs this step's values now
            self.pool.flush()

    def _body(self, model: DeviceModel) -> None:
        if self.state.role == "draft":
            self._draft(model)
        else:
            model.logits_argmax(model.hidden(self, 0), self.dev_out, 0)

    def _note(self, rec: Recording) -> None:
        """Capture ``rec`` when it equals the previous recording (the body is a function of the state
        alone, as far as two runs show); a body that touched host memory is never captured."""
        if rec.host_work:
            self._capturable, self._last = False, None
        elif self._last is not None and rec.same_as(self._last):
            self.captured, self._last = rec, None
        else:
            self._last = rec

    def _draft(self, model: DeviceModel) -> None:
        st, ops = self.state, model.ops
        p, d = st.pending, st.block
        kind = self.pool.drafter_kind
        if kind == "mask-block":
            hidden = model.hidden(self, d - 1)
            model.logits_argmax(ops.slice_rows(hidden, p - 1, st.width), self.dev_out, st.width - d)
            return
        # heads: the pending rows run causally on the base path; the heads recur from the last one
        hidden = model.hidden(self, 0)
        s = ops.slice_rows(hidden, p - 1, p)
        at = st.width - d
        model.logits_argmax(s, self.dev_out, at)
        for k in range(d - 1):
            e = ops.gather(model.embed, self.dev_out, count=1, offset=at + k)
            s = model.heads_step(k, s, e)
            model.logits_argmax(s, self.dev_out, at + k + 1)

    # ---- device-side decode-loop bookkeeping (runtime/verify_prep.py dispatches here) ---------------

    def prepare_from_draft(self, draft: VulkanStepRunner) -> None:
        """This (verify) runner's inputs from ``draft``'s outputs, on the device."""
        d = self.state.width
        self.pool.model.ops.prepare_verify(draft.dev_out, draft.dev_positions, draft.state.pending, d,
                                           self.dev_tokens, self.dev_positions)
        self.device_fed = True

    def resolve_into(self, next_draft: VulkanStepRunner) -> None:
        """``next_draft``'s inputs from this (verify) runner's outputs, on the device."""
        self.pool.model.ops.resolve_verify(self.dev_out, self.dev_positions, self.dev_tokens,
                                           next_draft.dev_tokens, next_draft.dev_positions)
        next_draft.device_fed = True


class VulkanStepPool:
    """The step pool of the Vulkan runtime: runners per replay state, one readback per ``flush``;
    implements ``runtime.protocols.StepPool``."""

    #: steps are not CUDA graphs (a runner replays its own recorded commands): no cross-session step lock
    capture = False

    def __init__(self, decoder: Decoder, kv: KVStore, *, runner: Runner | None = None, gpu_layers: int | None = None):
        """Layers ``[0, gpu_layers)`` (default all) and the LM head on the device (the API refuses plans that
        put the LM head on the CPU: not implemented). Raises ``UnsupportedLayer`` for a model whose layer
        spec this runtime does not implement."""
        from bitmtp.wgsl_fallback.runner import default_runner

        a = decoder.args
        if decoder.device.type != "cpu":
            raise BitMTPError("runtime='vulkan': load the model with device='cpu' (the Vulkan device holds its "
                              "own copy)")
        a.layer_spec.check(EXECUTOR, VULKAN_ACTIVATIONS, VULKAN_NORMS)  # before the device is opened
        gpu_layers = a.num_layers if gpu_layers is None else int(gpu_layers)
        self.decoder, self.kv = decoder, kv
        self.model = DeviceModel(decoder, kv, runner or default_runner(), gpu_layers)
        self.runners: dict[ReplayState, VulkanStepRunner] = {}
        self.pending: list[VulkanStepRunner] = []
        self.drafter = None
        self.fused_steps = False  # the WGSL step body has no one-pass (fused) variant
        self.drafter_kind: str | None = None
        self.mask_block = None  # the mask-block drafter's adapter (the CPU tail's mask rows need it)
        #: with CPU-offloaded layers the host takes part in every step; verify prep then runs on the host
        self.sync_each_step = gpu_layers < a.num_layers
        self.device_verify = not self.sync_each_step
        self.reads = 0
        self._staging: DeviceTensor | None = None

    def set_drafter(self, drafter) -> None:
        if drafter is self.drafter:
            return
        # the drafter classes whose adapter this device model uploads and runs (decoding.drafters)
        if isinstance(drafter, MaskBlockDrafter):
            self.model.set_mask_block(drafter.block)
            self.drafter_kind, self.mask_block = "mask-block", drafter.block
        elif isinstance(drafter, HeadsDrafter):
            self.model.set_heads(drafter.heads)
            self.drafter_kind, self.mask_block = "heads", None
        elif drafter is not None:
            raise BitMTPError(f"runtime='vulkan': the {getattr(drafter, 'kind', type(drafter).__name__)} drafter "
                              "does not run on the device (mask-block and heads adapters do); decode it with "
                              "runtime='torch'")
        self.runners = {s: r for s, r in self.runners.items() if s.role != "draft"}
        self.drafter = drafter

    def set_sampling(self, params) -> None:
        """Greedy only: the WGSL step ends in an argmax (``runtime.protocols.StepPool.set_sampling``)."""
        self.check_sampling(params)
        return None

    @staticmethod
    def check_sampling(params) -> None:
        """BitMTPError unless ``params`` is greedy (``runtime.protocols.StepPool.check_sampling``)."""
        if params is not None and not params.greedy:
            what = "temperature > 0" if params.samples else "repetition/presence/frequency penalties"
            raise BitMTPError(f"sampling: runtime='vulkan' decodes greedily only (its step shader ends in an argmax); "
                              f"{what} need runtime='torch' (the CPU or a CUDA GPU), or use temperature=0 without "
                              "penalties")

    def get(self, state: ReplayState) -> VulkanStepRunner:
        runner = self.runners.get(state)
        if runner is None:
            if state.role in ("fused", "tree"):
                raise BitMTPError(f"runtime='vulkan': one-pass steps with drafts (role {state.role!r}) run on "
                                  "runtime='torch'; here use the two-pass schedule or the lookup drafter")
            if state.role == "draft" and self.drafter is None:
                raise BitMTPError("draft step: no drafter is set (load an adapter or pass a drafter)")
            runner = self.runners[state] = VulkanStepRunner(self, state)
        return runner

    def flush(self) -> None:
        """Bring every pending runner's outputs to the host in ONE read (device copies into a staging
        buffer, then one map)."""
        if not self.pending:
            return
        r = self.model.r
        total = sum(run.dev_out.shape[0] for run in self.pending)
        if self._staging is None or self._staging.shape[0] < total:
            self._staging = r.empty((max(total, 256),), "u32")
        at = 0
        for run in self.pending:
            n = run.dev_out.shape[0]
            r.copy(run.dev_out.buffer, 0, self._staging.buffer, at * 4, n * 4)
            at += n
        raw = r.read(self._staging)[:total]
        self.reads += 1
        at = 0
        for run in self.pending:
            w = run.dev_out.shape[0] // 2
            ids, probs = Ops.split_argmax(raw[at:at + 2 * w])
            run.out_token.copy_(torch.from_numpy(ids))
            run.out_prob.copy_(torch.from_numpy(probs.copy()))
            at += 2 * w
        self.pending = []


__all__ = ["VulkanStepPool", "VulkanStepRunner", "DeviceModel", "VULKAN_ACTIVATIONS", "VULKAN_NORMS"]
