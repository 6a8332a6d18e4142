"""Training MTP adapters: ``mask-block`` (gated LoRA on a frozen base, default), ``heads`` (frozen
base) and ``full`` (joint NTP + MTP fine-tune of every weight, ``bitmtp.train.full``).

Objective (DESIGN.md "Training"): sequences get blocks of D − 1 mask rows after sampled anchors
(``bitmtp.train.masks``); the loss is Σ_k γ^k · CE at block position k, averaged over blocks. In
the frozen-base modes the NTP term of the joint objective is constant — the gated LoRA never
touches sequence rows — so it is not computed; ``full`` adds it.

Self-distillation (``self_distill=True``): block targets are the base model's own greedy
predictions under teacher forcing (the argmax of its sequence rows) instead of the corpus tokens,
so drafts learn what verification accepts.

Checkpoints (trainable tensors, optimizer, step, RNG, data order) are written atomically every
``checkpoint_every`` steps to ``<out>.ckpt/state.pt``; ``resume=True`` continues from there. A
checkpoint holds only tensors and plain Python values (numbers, strings, lists, tuples, dicts) and is
read with ``torch.load(weights_only=True)``: a crafted file cannot run code (:func:`load_checkpoint`). The adapter
folder (``full``: one GGUF file with the new base and its adapter) is written once at the end,
atomically, with the provenance in its config.
"""

from __future__ import annotations

import math
import os
import pickle
import platform
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bitmtp.errors import BitMTPError
from bitmtp.formats.adapters import AdapterConfig, BaseShape, save_adapter
from bitmtp.model.adapters import base_fingerprint, init_adapter_tensors
from bitmtp.model.decoder import Decoder
from bitmtp.train.forward import HeadsParams, MaskBlockParams, TrainView
from bitmtp.train.losses import weighted_block_ce
from bitmtp.train.masks import packed_layout, sample_anchors

MODES = ("mask-block", "heads", "full")


@dataclass
class TrainConfig:
    """Hyper-parameters and run control of :func:`train`."""

    out: str
    mode: str = "mask-block"
    block_size: int = 8
    rank: int = 8
    lora_alpha: float | None = None
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    seq_len: int = 256
    batch_size: int = 1
    anchors: int = 16
    #: more anchors per window whose block is one mask row (what a D = 2 step drafts): cheap signal
    #: for the first drafted position, the one every draft's acceptance starts with
    short_anchors: int = 0
    gamma: float = 0.8
    lr: float = 2e-3
    warmup: int = 20
    max_steps: int = 200
    time_budget: float | None = None  # seconds; stops (and saves) when exceeded
    seed: int = 0
    self_distill: bool = True
    checkpoint_every: int = 50
    resume: bool = False
    overwrite: bool = False
    save_dtype: str = "float16"
    data_description: str = ""
    init_from: str | None = None  # continue training an existing adapter (same kind, D, rank, targets)
    #: mask-block with self-distillation: the share of each row's loss taken against the base's whole
    #: next-token distribution instead of its argmax alone (0: argmax only, the earlier runs' loss)
    soft_targets: float = 0.0
    #: anchor blocks only on answer tokens of whole distill records (``answer_windows``): train on what
    #: decoding drafts — never the prompt, never a record cut from its prompt
    answer_only: bool = False

    def validate(self) -> None:
        if self.mode not in MODES:
            raise BitMTPError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.mode == "full":
            if not str(self.out).endswith(".gguf"):
                raise BitMTPError(f"out: the full fine-tune writes one GGUF file (base + adapter); give a path "
                                  f"ending in .gguf, got {self.out}")
            if self.init_from:
                raise BitMTPError("init_from: continues an adapter of a frozen base; the full mode fine-tunes "
                                  "the base itself (start from a checkpoint of it with --model instead)")
        if not 2 <= self.block_size <= 16:
            raise BitMTPError(f"block_size: D must be in 2..16, got {self.block_size}")
        if self.max_steps < 1:
            raise BitMTPError(f"max_steps: must be >= 1, got {self.max_steps}")
        if self.short_anchors < 0:
            raise BitMTPError(f"short_anchors: must be >= 0, got {self.short_anchors}")
        if self.short_anchors and self.mode == "heads":
            raise BitMTPError("short_anchors (--short-anchors): one-row mask blocks train mask rows; heads draft in "
                              "a chain from their anchor, so a heads run takes --anchors only")
        if self.answer_only and self.mode == "full":
            raise BitMTPError("answer_only (--answer-only): the full fine-tune also trains next-token prediction on "
                              "every sequence row; answer-only anchors are for the mask-block and heads adapters")
        if not 0.0 <= self.soft_targets <= 1.0:
            raise BitMTPError(f"soft_targets: must be in [0, 1], got {self.soft_targets}")
        if self.soft_targets and (self.mode != "mask-block" or not self.self_distill):
            raise BitMTPError("soft_targets (--soft-targets): the teacher distribution is the base's own next-token "
                              "distribution, taken for a mask-block adapter with self-distillation; drop it for "
                              f"mode {self.mode!r}" + ("" if self.self_distill else " and --no-self-distill"))
        if not 0 < self.gamma <= 1:
            raise BitMTPError(f"gamma: must be in (0, 1], got {self.gamma}")
        if Path(self.out).exists() and not self.overwrite and not self.resume:
            raise BitMTPError(f"out: {self.out} already exists; pass overwrite=True (--overwrite) to replace it")
        if self.resume:
            _check_checkpoint_present(self.out)


@dataclass
class TrainResult:
    path: Path
    steps: int
    tokens: int
    seconds: float
    losses: list[float]
    accuracy: list[float]  # per block position k = 1..D-1, over the last steps


CHECKPOINT_FILE = "state.pt"
# the checkpoint fields and their types; "base" and "fingerprint" are absent in checkpoints written
# before they were added (those resume without the base-model check)
_CHECKPOINT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "params": dict, "opt": dict, "step": int, "tokens": int, "seconds": (int, float), "losses": list,
    "order": list, "gen": torch.Tensor, "config": dict}
# run settings that must match the interrupted run: they shape the trainable tensors or the data
_RESUME_MUST_MATCH = ("mode", "block_size", "rank", "targets", "seq_len", "batch_size", "answer_only")


def _checkpoint_path(out: str | Path) -> Path:
    return Path(str(out) + ".ckpt")


def _start_over(ckpt: Path) -> str:
    return f"delete {ckpt} and run without --resume to start over"


def _check_checkpoint_present(out: str | Path) -> None:
    """``resume=True`` with nothing to resume is an error (not a silent fresh start that would then
    overwrite ``out``)."""
    ckpt = _checkpoint_path(out)
    state = ckpt / CHECKPOINT_FILE
    if not ckpt.exists():
        done = f"; {out} exists, so that run finished" if Path(out).exists() else ""
        raise BitMTPError(f"resume (--resume): no checkpoint {state} to continue{done} (a run writes one every "
                          f"--checkpoint-every steps and deletes it when it finishes); run without --resume to "
                          f"start a new run")
    if not state.is_file():
        raise BitMTPError(f"resume (--resume): {ckpt} has no {CHECKPOINT_FILE} (the run stopped before its first "
                          f"checkpoint, or the folder is not a bitmtp checkpoint); {_start_over(ckpt)}")


def _save_checkpoint(path: Path, state: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path / CHECKPOINT_FILE)


def load_checkpoint(out: str | Path) -> dict[str, Any]:
    """The checkpoint of an interrupted run writing ``out`` (``<out>.ckpt/state.pt``), read with
    ``torch.load(weights_only=True)``: only tensors and plain Python values are rebuilt, so a crafted
    file cannot run code while it loads.

    Raises:
        BitMTPError: no checkpoint; a file that is not a plain tensor checkpoint (it asks to build
            other objects); a damaged, truncated or empty file; a file without the checkpoint fields.
    """
    _check_checkpoint_present(out)
    ckpt = _checkpoint_path(out)
    path = ckpt / CHECKPOINT_FILE
    try:
        with warnings.catch_warnings():  # a legacy-format pickle warns about its protocol: irrelevant here
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():
            raise BitMTPError(f"resume (--resume): {path} is not a plain tensor checkpoint: it asks to build "
                              f"Python objects other than tensors, numbers, strings, lists and dicts, which could "
                              f"run code, so it was not loaded; {_start_over(ckpt)}") from None
        raise BitMTPError(f"resume (--resume): {path} is damaged ({_first_line(exc)}); {_start_over(ckpt)}") from None
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on a bad file is a bad file
        what = "empty" if path.stat().st_size == 0 else "damaged or truncated"
        raise BitMTPError(f"resume (--resume): {path} is {what} ({type(exc).__name__}: {_first_line(exc)}); "
                          f"{_start_over(ckpt)}") from None
    if not isinstance(state, dict):
        raise BitMTPError(f"resume (--resume): {path} holds a {type(state).__name__}, not a bitmtp training "
                          f"checkpoint; {_start_over(ckpt)}")
    for name, kind in _CHECKPOINT_FIELDS.items():
        if not isinstance(state.get(name), kind) or isinstance(state.get(name), bool):
            raise BitMTPError(f"resume (--resume): {path} is not a bitmtp training checkpoint (field {name!r} is "
                              f"missing or not a {getattr(kind, '__name__', 'number')}); {_start_over(ckpt)}")
    return state


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "no detail"


def _resume_from(state: dict[str, Any], cfg: TrainConfig, decoder: Decoder, fingerprint: str | None,
                 params: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                 n_windows: int) -> None:
    """Load a checkpoint's tensors, optimizer and RNG into this run after checking it is the same run:
    the same base model, adapter settings and data."""
    ckpt = _checkpoint_path(cfg.out)
    path = ckpt / CHECKPOINT_FILE
    fix = f"resume with the --model, --data and settings of the interrupted run, or {_start_over(ckpt)}"
    saved = state["config"]
    for name in _RESUME_MUST_MATCH:
        if name in saved and saved[name] != getattr(cfg, name):
            raise BitMTPError(f"resume (--resume): {path} was written by a run with {name}={saved[name]!r}, this "
                              f"run has {getattr(cfg, name)!r}; {fix}")
    base = state.get("base")
    if isinstance(base, dict):
        now = asdict(BaseShape.of(decoder.args))
        for name, value in now.items():
            if base.get(name) != value:
                raise BitMTPError(f"resume (--resume): {path} was written for another model ({name} "
                                  f"{base.get(name)!r}, this model {value!r}); {fix}")
    if isinstance(state.get("fingerprint"), str) and fingerprint and state["fingerprint"] != fingerprint:
        raise BitMTPError(f"resume (--resume): {path} was written for another model (same shape, other weights); "
                          f"{fix}")
    order = state["order"]
    if sorted(order) != list(range(n_windows)):
        raise BitMTPError(f"resume (--resume): {path} was written by a run on {len(order)} training windows, this "
                          f"run has {n_windows}; {fix}")
    try:
        params.load_state_dict(state["params"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise BitMTPError(f"resume (--resume): {path} does not fit this run's tensors ({_first_line(exc)}); "
                          f"{fix}") from None


def mask_block_loss(view: TrainView, params: MaskBlockParams, tokens: torch.Tensor, anchors: list[int],
                    block_size: int, gamma: float, self_distill: bool, widths: list[int] | None = None,
                    soft_weight: float = 0.0, block_weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and per-position top-1 accuracy ``[D−1]`` of one batch ``tokens [B, T]`` (shared anchors;
    ``widths``: mask rows per anchor's block, default D − 1; ``soft_weight``: the share of the loss
    against the base's whole next-token distribution, see ``weighted_block_ce``; ``block_weight [B, A]``:
    0 for a block that must not count, see :func:`anchor_weights`)."""
    bsz, t_len = tokens.shape
    lay = packed_layout(t_len, anchors, block_size, device=tokens.device, widths=widths)
    emb = view.embed[tokens]
    mask_rows = params.mask_embedding.to(emb.dtype).expand(bsz, lay.block_k.numel(), -1)
    # the gate keeps the sequence rows the base's own: they run without autograd (TrainView.hidden_gated)
    seq_hidden, block_hidden = view.hidden_gated(emb, mask_rows, lay.positions, lay.mask[None], lora=params)
    logits = view.logits(block_hidden)  # [B, R, V]
    soft = None
    if self_distill:
        with torch.no_grad():  # the base's greedy prediction of each sequence position
            seq_logits = view.logits(seq_hidden[:, lay.block_targets - 1])  # row i predicts position i + 1
            targets = seq_logits.argmax(-1)
            if soft_weight > 0:
                soft = torch.log_softmax(seq_logits.float(), -1)
    else:
        targets = tokens[:, lay.block_targets]
    rows = torch.tensor(widths if widths is not None else [block_size - 1] * len(anchors), device=tokens.device)
    return weighted_block_ce(logits, targets, lay.block_k, block_size, gamma, n_blocks=len(anchors), soft=soft,
                             soft_weight=soft_weight, block_weight=block_weight,
                             block_of_row=torch.arange(len(anchors), device=tokens.device).repeat_interleave(rows))


def anchor_weights(masks: list[list[bool]], window_ids: list[int], anchors: list[int],
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, A]`` float 0/1: whether window ``window_ids[b]`` may anchor a block at ``anchors[a]`` (its
    ``answer_windows`` mask). The anchors are shared by the batch's windows, so a block anchored in one
    window's prompt still runs there, it just does not count."""
    picked = torch.tensor([[masks[w][t] for t in anchors] for w in window_ids], dtype=torch.float32)
    return picked.to(device)


def anchors_and_widths(seq_len: int, block_size: int, full: int, short: int,
                       generator: torch.Generator) -> tuple[list[int], list[int] | None]:
    """One step's anchors: ``full`` blocks of D − 1 mask rows, then ``short`` blocks of one row (distinct
    among themselves; a short block may share its anchor with a full one — blocks never see each other).
    Widths are None when every block is full (the layout's default)."""
    anchors = sample_anchors(seq_len, block_size, full, generator)
    if not short:
        return anchors, None
    extra = sample_anchors(seq_len, 2, short, generator)
    return anchors + extra, [block_size - 1] * len(anchors) + [1] * len(extra)


def base_states(view: TrainView, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen base's final hidden states ``[B, T, hidden]`` and greedy next tokens ``[B, T]`` of
    ``tokens`` (causal, no grad): everything the heads loss needs from the base."""
    t_len = tokens.shape[1]
    with torch.no_grad():
        causal = torch.ones(t_len, t_len, dtype=torch.bool, device=tokens.device).tril()
        hidden = view.hidden(view.embed[tokens], torch.arange(t_len, device=tokens.device), causal[None])
        return hidden, view.logits(hidden).argmax(-1)


class BaseStateCache:
    """:func:`base_states` per training window, computed on a window's first visit and kept (float16
    hidden states on the host: 256 × 576 × 2 bytes = 295 kB a SmolLM2 window). The base is frozen,
    so from the second epoch on a heads step costs only the heads and their LM-head calls."""

    def __init__(self, view: TrainView, max_bytes: int = 2 << 30):
        self.view = view
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hits = 0
        self.max_bytes = max_bytes  # past this, windows are recomputed rather than kept
        self.nbytes = 0

    def get(self, window_ids: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [i for i, w in enumerate(window_ids) if w not in self.store]
        self.hits += len(window_ids) - len(missing)
        if missing:
            hidden, greedy = base_states(self.view, tokens[missing])
            computed = {}
            for j, i in enumerate(missing):
                entry = (hidden[j].to("cpu", torch.float16), greedy[j].cpu())
                computed[window_ids[i]] = entry
                size = entry[0].numel() * 2 + entry[1].numel() * 8
                if self.nbytes + size <= self.max_bytes:
                    self.store[window_ids[i]] = entry
                    self.nbytes += size
            pairs = [self.store.get(w) or computed[w] for w in window_ids]
        else:
            pairs = [self.store[w] for w in window_ids]
        dev = tokens.device
        return (torch.stack([h for h, _ in pairs]).to(dev, self.view.dtype),
                torch.stack([g for _, g in pairs]).to(dev))


def heads_loss(view: TrainView, params: HeadsParams, tokens: torch.Tensor, anchors: list[int], block_size: int,
               gamma: float, self_distill: bool, states: tuple[torch.Tensor, torch.Tensor] | None = None,
               block_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads: s_0 = the base's hidden state at the anchor, teacher-forced chain over the true tokens.
    ``states``: the windows' :func:`base_states` when cached (:class:`BaseStateCache`)."""
    bsz, t_len = tokens.shape
    hidden, greedy = states if states is not None else base_states(view, tokens)
    if not self_distill:
        greedy = None
    anc = torch.tensor(anchors, device=tokens.device)
    state = hidden[:, anc]  # [B, A, H]
    logits, targets, ks = [], [], []
    for k in range(block_size - 1):
        state = params.step(k, state, view.embed[tokens[:, anc + k + 1]])
        logits.append(view.logits(state))
        tgt_pos = anc + k + 2
        targets.append(greedy[:, tgt_pos - 1] if self_distill else tokens[:, tgt_pos])
        ks.append(torch.full_like(anc, k + 1))
    # order as block rows: anchor-major, then k
    logits_t = torch.stack(logits, 2).flatten(1, 2)
    targets_t = torch.stack(targets, 2).flatten(1, 2)
    k_t = torch.stack(ks, 1).flatten()
    return weighted_block_ce(logits_t, targets_t, k_t, block_size, gamma, n_blocks=len(anchors),
                             block_weight=block_weight,
                             block_of_row=torch.arange(len(anchors), device=tokens.device).repeat_interleave(
                                 block_size - 1))


def _tensors_to_continue(cfg: TrainConfig, config: AdapterConfig, decoder: Decoder) -> dict[str, torch.Tensor]:
    """The tensors of ``cfg.init_from``, checked to be the adapter this run would make. A mask-block
    adapter of a lower rank grows to this run's rank (:func:`grow_lora_rank`)."""
    from bitmtp.formats.adapters import load_adapter

    old, tensors = load_adapter(cfg.init_from)
    old.check_base(decoder.args)
    for name in ("kind", "block_size"):
        if getattr(old, name) != getattr(config, name):
            raise BitMTPError(f"init_from: {cfg.init_from} has {name}={getattr(old, name)!r}, this run "
                              f"{getattr(config, name)!r}")
    if old.kind == "mask-block" and sorted(old.targets) != sorted(config.targets):
        raise BitMTPError(f"init_from: {cfg.init_from} has targets {old.targets}, this run {config.targets}")
    tensors = {k: v.float() for k, v in tensors.items()}
    if old.rank != config.rank:
        if old.kind != "mask-block" or old.rank > config.rank:
            raise BitMTPError(f"init_from: {cfg.init_from} has rank={old.rank}, this run {config.rank} (a "
                              f"mask-block adapter can grow to a higher --rank; nothing else changes rank)")
        if old.lora_alpha is not None or config.lora_alpha is not None:
            raise BitMTPError("init_from: growing the LoRA rank keeps the adapter's function only with scaling 1 "
                              "(no --lora-alpha); alpha/rank would rescale the trained deltas")
        tensors = grow_lora_rank(tensors, config, seed=cfg.seed)
    return tensors


def grow_lora_rank(tensors: dict[str, torch.Tensor], config: AdapterConfig, *, seed: int = 0
                   ) -> dict[str, torch.Tensor]:
    """A mask-block adapter's tensors at ``config.rank`` (≥ theirs): each LoRA pair gets new components
    with ``A`` drawn as a fresh adapter's and ``B = 0``, so ``B·A`` — the adapter's function — is
    unchanged at the first step, and training uses the extra capacity from there (LoRA's own start)."""
    fresh = init_adapter_tensors(config, seed=seed)
    out = dict(tensors)
    for name, value in tensors.items():
        if name.endswith(".lora_A"):  # [r, in]: old rows kept, new rows fresh
            out[name] = torch.cat([value, fresh[name][value.shape[0]:]], 0)
        elif name.endswith(".lora_B"):  # [out, r]: new columns zero
            out[name] = torch.cat([value, torch.zeros(value.shape[0], config.rank - value.shape[1])], 1)
    return out


def train(decoder: Decoder, windows: list[list[int]], cfg: TrainConfig, *, progress: bool = True,
          export: dict | None = None, anchor_masks: list[list[bool]] | None = None) -> TrainResult:
    """Train an adapter of ``cfg.mode`` on token ``windows`` (from ``bitmtp.train.data.token_windows``,
    or with ``anchor_masks`` from ``bitmtp.train.data.answer_windows`` when ``cfg.answer_only``: a block
    anchored where its window's mask is False does not count).

    ``full`` mode fine-tunes ``decoder`` itself: on return it holds the trained weights, and
    ``cfg.out`` is a GGUF file of it with its adapter (``export``: extra keyword arguments of
    ``bitmtp.model.gguf_io.export_gguf`` — tokenizer, tokenizer_fields, name)."""
    cfg.validate()
    if not windows:
        raise BitMTPError("data: no training windows")
    if any(len(w) != len(windows[0]) for w in windows):
        raise BitMTPError("data: training windows must all have the same length")
    if len(windows[0]) < cfg.block_size + 2:
        raise BitMTPError(f"seq_len: windows of {len(windows[0])} tokens are too short for D={cfg.block_size}")
    if cfg.answer_only != (anchor_masks is not None):
        raise BitMTPError("answer_only: pass the windows and anchor masks of bitmtp.train.answer_windows together with "
                          "answer_only=True (and neither without it)")
    if anchor_masks is not None and (len(anchor_masks) != len(windows) or any(
            len(m) != len(w) for m, w in zip(anchor_masks, windows, strict=True))):
        raise BitMTPError("anchor_masks: one mask per window, as long as the window (bitmtp.train.answer_windows)")
    device = decoder.device
    use_cuda = device.type == "cuda"
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    view = TrainView(decoder, torch.float32) if cfg.mode != "full" else None  # full: FullParams builds its own
    kind = cfg.mode
    config = AdapterConfig(kind="mask-block" if kind == "full" else kind, block_size=cfg.block_size, rank=cfg.rank,
                           base=BaseShape.of(decoder.args), targets=[] if kind == "full" else list(cfg.targets),
                           discount_gamma=cfg.gamma, lora_alpha=cfg.lora_alpha, fingerprint=base_fingerprint(decoder))
    if kind == "full":
        init = {}  # a mask embedding only (no LoRA targets): mask rows run the fine-tuned weights themselves
    elif cfg.init_from:
        init = _tensors_to_continue(cfg, config, decoder)
    else:
        init = init_adapter_tensors(config, seed=cfg.seed)
        if kind == "mask-block":
            # start the mask embedding at the mean token embedding: a neutral "some token" input
            init["mask_embedding"] = decoder.embed.detach().float().mean(0).cpu()
    if kind == "full":
        from bitmtp.train.full import FullParams, full_loss

        params = FullParams(decoder, decoder.embed.detach().float().mean(0)).to(device)
        view, loss_fn = params.view, full_loss
    elif kind == "mask-block":
        params = MaskBlockParams(config, init).to(device)
        loss_fn = mask_block_loss
    else:
        params = HeadsParams(config, init, eps=decoder.args.rms_norm_eps).to(device)
        loss_fn = heads_loss
    # heads train on a frozen base: its hidden states are computed once per window (BaseStateCache)
    cache = BaseStateCache(view) if kind == "heads" else None
    opt = torch.optim.AdamW(params.parameters(), lr=cfg.lr, weight_decay=0.0)
    order = torch.randperm(len(windows), generator=gen).tolist()
    step, seen_tokens, elapsed, losses, accs = 0, 0, 0.0, [], []
    ckpt = _checkpoint_path(cfg.out)
    if cfg.resume:
        state = load_checkpoint(cfg.out)
        _resume_from(state, cfg, decoder, config.fingerprint, params, opt, gen, len(windows))
        step, seen_tokens, elapsed = state["step"], state["tokens"], float(state["seconds"])
        losses, order = [float(x) for x in state["losses"]], [int(i) for i in state["order"]]
    t_start = time.perf_counter() - elapsed

    def lr_at(s):  # linear warm-up, cosine decay to 10 %
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        frac = (s - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, desc=f"train {kind} D={cfg.block_size}", unit="step")
    try:
        while step < cfg.max_steps:
            if cfg.time_budget is not None and time.perf_counter() - t_start > cfg.time_budget:
                break
            idx = [order[(step * cfg.batch_size + b) % len(order)] for b in range(cfg.batch_size)]
            tokens = torch.tensor([windows[i] for i in idx], dtype=torch.long, device=device)
            anchors, widths = anchors_and_widths(tokens.shape[1], cfg.block_size, cfg.anchors, cfg.short_anchors,
                                                 gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_cuda):
                extra = {"states": cache.get(idx, tokens)} if cache is not None else {}
                if widths is not None:
                    extra["widths"] = widths
                if cfg.soft_targets:
                    extra["soft_weight"] = cfg.soft_targets
                if anchor_masks is not None:
                    extra["block_weight"] = anchor_weights(anchor_masks, idx, anchors, device)
                loss, acc = loss_fn(view, params, tokens, anchors, cfg.block_size, cfg.gamma, cfg.self_distill,
                                    **extra)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0)
            opt.step()
            step += 1
            seen_tokens += tokens.numel()
            losses.append(float(loss.detach()))
            accs.append(acc.cpu())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{float(acc[0]):.2f}")
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                _save_checkpoint(ckpt, {"params": params.state_dict(), "opt": opt.state_dict(), "step": step,
                                        "tokens": seen_tokens, "seconds": time.perf_counter() - t_start,
                                        "losses": losses, "order": order, "gen": gen.get_state(),
                                        "config": asdict(cfg), "base": asdict(BaseShape.of(decoder.args)),
                                        "fingerprint": config.fingerprint})
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t_start
    recent = torch.stack(accs[-20:]).nanmean(0).tolist() if accs else []  # NaN: a step with no block kept
    config.training = {
        "mode": kind, "data": cfg.data_description, "steps": step, "tokens": seen_tokens,
        "minutes": round(seconds / 60, 2), "seq_len": len(windows[0]), "batch_size": cfg.batch_size,
        "anchors": cfg.anchors, **({"short_anchors": cfg.short_anchors} if cfg.short_anchors else {}),
        **({"soft_targets": cfg.soft_targets} if cfg.soft_targets else {}),
        **({"answer_only": True} if cfg.answer_only else {}),
        "lr": cfg.lr, "seed": cfg.seed, "self_distill": cfg.self_distill,
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, torch {torch.__version__}, threads "
                   f"{torch.get_num_threads()}" + (f", {torch.cuda.get_device_name()}" if use_cuda else ""),
        "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4) if losses else None,
        "block_accuracy": [round(a, 3) for a in recent],
    }
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.save_dtype]
    tensors = {k: v.to(dtype) for k, v in params.tensors().items()}
    if kind == "full":
        from bitmtp.model.gguf_io import export_gguf
        from bitmtp.train.full import write_back

        write_back(params, decoder)
        config.fingerprint = base_fingerprint(decoder)  # the new base's
        path = export_gguf(decoder, cfg.out, adapter=(config, tensors), overwrite=cfg.overwrite or cfg.resume,
                           progress=progress, **(export or {}))
    else:
        path = save_adapter(cfg.out, config, tensors, overwrite=cfg.overwrite or cfg.resume)
    shutil.rmtree(ckpt, ignore_errors=True)
    return TrainResult(path, step, seen_tokens, seconds, losses, recent)
