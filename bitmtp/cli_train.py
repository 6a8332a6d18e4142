"""``python -m bitmtp train``, ``eval-acceptance`` and ``bench`` (registered by bitmtp.cli; the argument
checks come from bitmtp.cli_common)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bitmtp.cli_common import (
    at_least,
    between,
    checked,
    device_name,
    existing,
    positive_float,
    writable_dir,
    writable_file,
)


def _drafting_policies() -> tuple[str, ...]:
    """The registered policies that draft (AR, the reference, always runs)."""
    from bitmtp.decoding import get_policy, policy_names

    return tuple(n for n in policy_names() if get_policy(n).drafts)


def parse_duration(text: str | None) -> float | None:
    """``"90"`` / ``"90s"`` / ``"20m"`` / ``"1.5h"`` → seconds."""
    if text is None:
        return None
    from bitmtp.errors import BitMTPError

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    if not m:
        raise BitMTPError(f"--time-budget: expected a duration like 90s, 20m or 1.5h, got {text!r}")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds <= 0:  # would stop before the first step and save an untrained adapter
        raise BitMTPError(f"--time-budget: must be longer than 0, got {text!r}; e.g. 20m")
    return seconds


def parse_list(flag: str, text: str, kind: type, allowed: tuple | None = None,
               bounds: tuple[int, int] | None = None) -> list:
    """A comma-separated option (``--policies speculative,hybrid``, ``--block-sizes 4,8``) → its items,
    each converted by ``kind`` and checked against ``allowed`` / ``bounds``; an empty list fails."""
    from bitmtp.errors import BitMTPError

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise BitMTPError(f"{flag}: give at least one value, separated by commas, got {text!r}")
    out = []
    for t in items:
        try:
            value = kind(t)
        except ValueError:
            raise BitMTPError(f"{flag}: {t!r} is not a{'n integer' if kind is int else ' ' + kind.__name__}; "
                              f"give values separated by commas, e.g. 4,8") from None
        if allowed is not None and value not in allowed:
            raise BitMTPError(f"{flag}: unknown {t!r}; choose from {', '.join(allowed)}")
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise BitMTPError(f"{flag}: {value} is outside {bounds[0]}..{bounds[1]}")
        out.append(value)
    return out


def _load(args):
    import bitmtp
    from bitmtp.cli_common import default_model_path

    path = args.model or default_model_path()
    # train: the bare base (no "adapter" option); eval/bench/distill: --adapter, else the shipped one
    adapter = (getattr(args, "adapter", None) or "auto") if hasattr(args, "adapter") else None
    return bitmtp.load(path, capacity=args.capacity, device=args.device, quantize=args.quantize, adapter=adapter)


def _load_transformers(source: str | None, device: str):
    """The model at ``source`` (default: the embedded one) as a float32 transformers causal LM on ``device``: a
    GGUF file through transformers' GGUF reader, or a Hugging Face folder."""
    from bitmtp.cli_common import default_model_path
    from bitmtp.errors import BitMTPError

    path = Path(source) if source else Path(default_model_path())
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise BitMTPError(f"--engine transformers: transformers is not installed ({exc}); pip install "
                          f"'bitmtp[hf]', or use --engine bitmtp") from exc
    try:
        if path.is_file() and path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         torch_dtype=torch.float32)
        elif path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        else:
            raise BitMTPError(f"--model: {path} is neither a .gguf file nor a Hugging Face folder; --engine "
                              f"transformers reads one of those")
    except (ImportError, OSError, ValueError) as exc:
        raise BitMTPError(f"--engine transformers: transformers could not load {path} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); a GGUF model also needs `pip install "
                          f"gguf`; or use --engine bitmtp") from exc
    return model.to(device).eval()


def _cmd_train(args: argparse.Namespace) -> int:
    import logging

    import torch

    from bitmtp.train import TrainConfig, train
    from bitmtp.train.data import training_windows

    logging.basicConfig(level=logging.WARNING, format="bitmtp: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(out=args.out, mode=args.mode, block_size=args.block_size, rank=args.rank,
                      lora_alpha=args.lora_alpha, seq_len=args.seq_len, batch_size=args.batch_size,
                      anchors=args.anchors, short_anchors=args.short_anchors, gamma=args.gamma, lr=args.lr,
                      max_steps=args.max_steps,
                      time_budget=parse_duration(args.time_budget), seed=args.seed,
                      self_distill=not args.no_self_distill, checkpoint_every=args.checkpoint_every,
                      resume=args.resume, overwrite=args.overwrite, save_dtype=args.save_dtype,
                      init_from=args.init_from, soft_targets=args.soft_targets, answer_only=args.answer_only)
    cfg.validate()  # refuse an existing output before loading anything
    model = _load(args)
    if model.tokenizer is None:
        from bitmtp.errors import BitMTPError

        raise BitMTPError("--model: training on text needs a model with a tokenizer")
    data = args.data or ["stdlib"]
    max_tokens = args.max_tokens or cfg.max_steps * cfg.batch_size * cfg.seq_len
    eos = model.args.eos_token_id[0] if model.args.eos_token_id else None
    windows, masks = training_windows(data, model.tokenizer, cfg.seq_len, answer_only=cfg.answer_only,
                                      max_context=model.args.max_position_embeddings, eos_token_id=eos,
                                      max_tokens=max_tokens, split="train", shuffle_seed=cfg.seed,
                                      vocab_size=model.args.vocab_size)
    split = "train split, " if "stdlib" in map(str, data) else ""  # only the stdlib corpus is split
    packing = "whole records, blocks on answer tokens only, " if cfg.answer_only else ""
    cfg.data_description = (f"{', '.join(map(str, data))} ({split}{packing}{len(windows)} windows of {cfg.seq_len} "
                            f"tokens, shuffled with seed {cfg.seed})")
    what = "full fine-tune (all weights, NTP + MTP)" if cfg.mode == "full" else f"{cfg.mode} adapter"
    print(f"bitmtp: training a {what} (D={cfg.block_size}, rank {cfg.rank}) on {len(windows)} windows "
          f"of {cfg.seq_len} tokens; checkpoints in {cfg.out}.ckpt", file=sys.stderr)
    export = None
    if cfg.mode == "full":
        export = dict(tokenizer=model.tokenizer, tokenizer_fields=model.gguf_tokenizer_fields,
                      name=f"{Path(str(model.source)).stem}-bitmtp-full")
    res = train(model.decoder, windows, cfg, progress=not args.no_progress, export=export, anchor_masks=masks)
    print(f"bitmtp: wrote {res.path} after {res.steps} steps, {res.tokens} tokens, {res.seconds / 60:.1f} min; "
          f"block accuracy (k=1..{cfg.block_size - 1}): {', '.join(f'{a:.2f}' for a in res.accuracy)}",
          file=sys.stderr)
    return 0


def _cmd_distill(args: argparse.Namespace) -> int:
    import torch

    from bitmtp.train.distill import corpus_prompts, distill_corpus, distill_prompt_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        from bitmtp.errors import BitMTPError

        raise BitMTPError(f"--out: {out} exists; pass --overwrite to replace it")
    # --engine transformers uses bitmtp's model for its tokenizer, chat template and end ids only: kept on the CPU
    # (a GGUF's blocks stay unread there), whatever --device the transformers model runs on
    model = _load(argparse.Namespace(**{**vars(args), "device": "cpu"}) if args.engine == "transformers" else args)
    exclude = corpus_prompts(args.exclude_prompts_of or [])
    prompts = distill_prompt_ids(model, args.data or ["stdlib"], args.count, chat_fraction=args.chat_fraction,
                                 lines=args.lines, seed=args.seed, general_fraction=args.general_fraction,
                                 general_pool=args.general_pool, exclude=exclude)
    if args.engine == "transformers":
        from bitmtp.train.distill import distill_corpus_hf

        hf = _load_transformers(args.model, args.device)
        print(f"bitmtp: {len(prompts)} prompts x {args.new_tokens} greedy tokens with transformers' generate, "
              f"{args.batch_size} a call on {args.device} -> {out}", file=sys.stderr)
        st = distill_corpus_hf(hf, prompts, out, eos_ids=model.eos_ids(None), max_new_tokens=args.new_tokens,
                               batch_size=args.batch_size, overwrite=args.overwrite, resume=args.resume,
                               progress=not args.no_progress)
    else:
        policy, block = (("ar", None) if args.policy == "ar" or model.drafter is None
                         else ("speculative", args.block_size))
        print(f"bitmtp: {len(prompts)} prompts x {args.new_tokens} greedy tokens with {policy}"
              + (f" D={block}" if block else "") + f" -> {out}", file=sys.stderr)
        st = distill_corpus(model, prompts, out, max_new_tokens=args.new_tokens, policy=policy, block_size=block,
                            overwrite=args.overwrite, resume=args.resume, progress=not args.no_progress)
    print(f"bitmtp: wrote {st.path}: {st.records} records, {st.prompt_tokens} prompt + {st.generated_tokens} "
          f"generated tokens in {st.seconds / 60:.1f} min; train on it with "
          f"python -m bitmtp train --data {st.path} ...", file=sys.stderr)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from bitmtp.errors import BitMTPError
    from bitmtp.train.evaluate import evaluate_acceptance, format_table, prompt_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    model = _load(args)
    if model.drafter is None:
        raise BitMTPError("--adapter: eval-acceptance needs an MTP adapter (no shipped adapter matches this model)")
    policies = parse_list("--policies", args.policies, str, allowed=_drafting_policies())
    blocks = parse_list("--block-sizes", args.block_sizes, int, bounds=(2, 16))
    out = {}
    for kind in args.prompts:
        rows = evaluate_acceptance(model, prompt_ids(model, kind, args.count), policies=policies, block_sizes=blocks,
                                   max_new_tokens=args.max_new_tokens, tau=args.tau, min_prefix=args.min_prefix,
                                   stop_at_eos=args.stop_at_eos, schedule=args.schedule,
                                   progress=not args.no_progress)
        out[kind] = rows
        if not args.json:
            print(format_table(rows, title=f"{kind} prompts, adapter {model.adapter_config.kind} "
                                          f"(D={model.adapter_config.block_size})"))
            print()
    if args.json:
        print(json.dumps({k: [r.__dict__ for r in v] for k, v in out.items()}, indent=2))
    if args.plot:
        _plot(out, args.plot)
        print(f"bitmtp: wrote {args.plot}", file=sys.stderr)
    return 0


def _plot(results: dict, path: str) -> None:
    """Speedup over AR and mean committed tokens per iteration, per (policy, D), one panel each."""
    from bitmtp.errors import BitMTPError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BitMTPError("--plot: needs matplotlib (pip install matplotlib)") from exc
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sets = list(results)
    labels = [f"{r.policy}\nD={r.block_size}" for r in results[sets[0]]]
    width = 0.8 / len(sets)
    for i, kind in enumerate(sets):
        xs = [j + i * width for j in range(len(labels))]
        axes[0].bar(xs, [r.speedup_vs_ar for r in results[kind]], width, label=kind)
        axes[1].bar(xs, [r.mean_committed for r in results[kind]], width, label=kind)
    for ax, title in ((axes[0], "tokens/s over AR (same runtime)"), (axes[1], "mean committed tokens / iteration")):
        ax.set_xticks([j + width * (len(sets) - 1) / 2 for j in range(len(labels))], labels)
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _model_args(p: argparse.ArgumentParser) -> None:
    checked(p.add_argument("--model", help="HF checkpoint folder or .gguf file (default: the embedded "
                                           "SmolLM2-135M-Instruct)"), existing("model folder or .gguf file"))
    checked(p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)"), device_name)
    p.add_argument("--quantize", choices=["ternary"], help="ternarize float linear weights by absmean")
    checked(p.add_argument("--capacity", type=int, default=1024, metavar="TOKENS",
                           help="KV capacity in tokens (default 1024)"), at_least(1))
    checked(p.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)"),
            at_least(1, "leave it out for torch's choice"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_prompt_set(flag: str, value: str) -> None:
    if value not in ("code", "chat", "docs") and not Path(value).is_file():
        from bitmtp.errors import BitMTPError

        raise BitMTPError(f"{flag}: {value!r} is neither 'code', 'chat', 'docs' nor an existing text file (one "
                          f"prompt per line)")


def _eval_args(p: argparse.ArgumentParser, *, prompts: list[str], count: int, policies: str, blocks: str) -> None:
    """The options eval-acceptance and bench share (with their own defaults)."""
    checked(p.add_argument("--adapter", metavar="DIR",
                           help="adapter folder (default: the shipped adapter matching the model)"), existing("folder"))
    checked(p.add_argument("--prompts", nargs="+", default=prompts, metavar="SET",
                           help=f"prompt sets: code (held-out stdlib functions), chat, docs (held-out long "
                                f"documents of 500-1500 tokens, each with a request to summarise it or answer from "
                                f"it; load with --capacity 2048), or a text file with one prompt per line "
                                f"(default: {' '.join(prompts)})"),
            _check_prompt_set)
    checked(p.add_argument("--count", type=int, default=count, help=f"prompts per set (default {count})"),
            at_least(1))
    checked(p.add_argument("--policies", default=policies,
                           help=f"comma-separated policies among {', '.join(_drafting_policies())} (AR always "
                                f"runs as the reference; default {policies})"),
            lambda flag, v: parse_list(flag, v, str, allowed=_drafting_policies()))
    checked(p.add_argument("--block-sizes", default=blocks, metavar="D,D",
                           help=f"comma-separated block sizes, each 2..16 (default {blocks})"),
            lambda flag, v: parse_list(flag, v, int, bounds=(2, 16)))
    checked(p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                           help="tokens per prompt (default 64)"), at_least(1))
    checked(p.add_argument("--tau", type=float, default=0.9, help="confidence threshold in (0, 1] (default 0.9)"),
            between(0.0, 1.0, low_open=True))
    checked(p.add_argument("--min-prefix", type=int, metavar="M", help="hybrid m (default max(2, D // 2))"),
            at_least(0))
    from bitmtp.decoding.policies import SCHEDULES

    p.add_argument("--schedule", choices=SCHEDULES,
                   help="the speculative policy's schedule (default two-pass); one-pass schedules report each "
                        "guess position's acceptance from the decode stats, and top2 counts the first position "
                        "accepted when the mask row's first or second choice is (use with --policies speculative)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop each generation at the model's end-of-sequence token, as a user's does (default: "
                        "run --max-new-tokens past it, the same count per prompt)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    checked(p.add_argument("--plot", metavar="PNG",
                           help="also save a bar chart (speedup over AR, committed tokens) to this .png, .svg or "
                                ".pdf file"), writable_file((".png", ".svg", ".pdf")))
    _model_args(p)


def _check_train(args: argparse.Namespace) -> None:
    from bitmtp.errors import BitMTPError

    if args.resume and args.init_from:
        raise BitMTPError("--resume and --init-from: a resumed run continues its checkpoint; drop --init-from")
    if args.seq_len < args.block_size + 2:
        raise BitMTPError(f"--seq-len: windows of {args.seq_len} tokens are too short for --block-size "
                          f"{args.block_size}; give at least {args.block_size + 2}")


def _check_distill(args: argparse.Namespace) -> None:
    from bitmtp.errors import BitMTPError

    if args.resume and args.overwrite:
        raise BitMTPError("--resume and --overwrite: --resume continues OUT.partial, --overwrite starts over; "
                          "give one")


def add_commands(sub) -> None:
    tr = sub.add_parser(
        "train", help="train an MTP adapter (mask-block or heads) on local files",
        description="Train an MTP adapter on a frozen base model from local text/code files, folders or JSONL "
                    "(never a download; default data: Python's standard-library sources, train split). The "
                    "objective is DESIGN.md's: blocks of D-1 mask rows after sampled anchors, loss sum_k "
                    "gamma^k CE at block position k; with self-distillation (default) the targets are the base "
                    "model's own greedy predictions. Checkpoints go to OUT.ckpt every --checkpoint-every steps; "
                    "--resume continues an interrupted run. A checkpoint holds only tensors and plain values and "
                    "is read without running code (torch.load weights_only).")
    checked(tr.add_argument("--out", required=True,
                            help="adapter folder to write (--mode full: a .gguf file); its parent folder must exist; "
                                 "refused if it exists, see --overwrite"), writable_dir)
    tr.add_argument("--data", nargs="+", metavar="PATH",
                    help="files, folders or .jsonl ('text' or chat 'messages'); 'stdlib' = Python's standard "
                         "library (default)")
    tr.add_argument("--mode", default="mask-block", choices=["mask-block", "heads", "full"],
                    help="mask-block: mask embedding + gated LoRA on mask rows (default); heads: Divine recurrent "
                         "draft heads; full: joint NTP+MTP fine-tune of every weight (ternary layers by absmean "
                         "STE) written as one GGUF with its adapter - meant for a GPU (--device cuda)")
    checked(tr.add_argument("--block-size", type=int, default=8, metavar="D",
                            help="tokens drafted per iteration, 2..16 (default 8)"), between(2, 16))
    checked(tr.add_argument("--rank", type=int, default=8, help="LoRA / head rank (default 8); with --init-from, "
                            "a mask-block adapter may grow to a higher rank"), at_least(1))
    checked(tr.add_argument("--lora-alpha", type=float, help="LoRA alpha (scaling alpha/rank; default: scaling 1)"),
            positive_float())
    checked(tr.add_argument("--seq-len", type=int, default=256, metavar="TOKENS",
                            help="training window in tokens, at least D + 2 (default 256)"), at_least(4))
    checked(tr.add_argument("--batch-size", type=int, default=1, help="windows per step (default 1)"), at_least(1))
    checked(tr.add_argument("--anchors", type=int, default=16, help="blocks per window (default 16)"), at_least(1))
    checked(tr.add_argument("--short-anchors", type=int, default=0, metavar="N",
                            help="N more blocks per window of one mask row each, as a D = 2 step drafts: cheap "
                                 "training of the first drafted position (mask-block, full; default 0)"),
            at_least(0))
    checked(tr.add_argument("--soft-targets", type=float, default=0.0, metavar="W",
                            help="share in [0, 1] of each mask row's loss taken against the base's whole next-token "
                                 "distribution rather than its argmax alone (mask-block with self-distillation; "
                                 "default 0)"),
            between(0.0, 1.0))
    tr.add_argument("--answer-only", action="store_true",
                    help="anchor draft blocks only on answer tokens, with windows of whole records (--data: distill "
                         "JSONL with 'prompt_tokens', as `bitmtp distill` writes): train on what decoding drafts, "
                         "never the prompt (mask-block, heads)")
    checked(tr.add_argument("--gamma", type=float, default=0.8,
                            help="loss discount in (0, 1]: block position k weighs gamma^k (default 0.8)"),
            between(0.0, 1.0, low_open=True))
    checked(tr.add_argument("--lr", type=float, default=2e-3,
                            help="peak learning rate (warm-up, cosine decay; default 2e-3)"), positive_float())
    checked(tr.add_argument("--max-steps", type=int, default=200, help="optimizer steps (default 200)"), at_least(1))
    checked(tr.add_argument("--time-budget", metavar="DURATION",
                            help="stop (and save) after this long, e.g. 90s, 20m, 1.5h (default: no limit)"),
            lambda flag, v: parse_duration(v))
    checked(tr.add_argument("--max-tokens", type=int,
                            help="corpus tokens to read (default: enough for --max-steps)"), at_least(1))
    tr.add_argument("--seed", type=int, default=0, help="seed of data order, anchors and init (default 0)")
    tr.add_argument("--no-self-distill", action="store_true", help="train on the corpus tokens instead of the "
                                                                    "base model's greedy predictions")
    checked(tr.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS",
                            help="steps between checkpoints in OUT.ckpt (default 50; 0: none)"), at_least(0))
    tr.add_argument("--resume", action="store_true",
                    help="continue the interrupted run from OUT.ckpt (same --model, --data and settings)")
    checked(tr.add_argument("--init-from", metavar="DIR",
                            help="start from this adapter's tensors (same kind, D, rank)"), existing("folder"))
    tr.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    tr.add_argument("--save-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                    help="dtype of the saved tensors (default float16)")
    _model_args(tr)
    tr.set_defaults(func=_cmd_train, check=_check_train)

    di = sub.add_parser(
        "distill", help="write a self-distillation corpus: the base model's greedy continuations (JSONL)",
        description="Generate greedy continuations of code snippets (train split of the sources; a fraction "
                    "asked about through the chat template) with the base model itself and write them as JSONL "
                    "token records for `train --data`. Drafts trained on the model's own output see at training "
                    "what they see at inference. Uses speculative decoding when the model has an adapter "
                    "(exact: the tokens are AR greedy's). Records are appended to OUT.partial as they are "
                    "made; --resume continues an interrupted run.")
    checked(di.add_argument("--out", required=True,
                            help="JSONL file to write; its folder must exist (refused if it exists, see --overwrite)"),
            writable_file())
    di.add_argument("--data", nargs="+", metavar="PATH", help="where the code snippets come from (default stdlib)")
    checked(di.add_argument("--count", type=int, default=400, help="prompts (default 400)"), at_least(1))
    checked(di.add_argument("--new-tokens", type=int, default=160, metavar="N",
                            help="greedy tokens per prompt (default 160)"), at_least(1))
    checked(di.add_argument("--chat-fraction", type=float, default=0.25,
                            help="fraction in [0, 1] of prompts asked through the chat template (default 0.25)"),
            between(0.0, 1.0))
    checked(di.add_argument("--general-fraction", type=float, default=0.0,
                            help="fraction in [0, 1] of prompts that are general chat questions and instructions "
                                 "(bitmtp.train.chat_prompts; never the eval's chat prompts) instead of code "
                                 "snippets (default 0)"),
            between(0.0, 1.0))
    di.add_argument("--general-pool", default="xl", choices=["xl", "xxl", "wide", "base"],
                    help="the general prompt set: xl (~3100 prompts, default); xxl (xl, then each xl prompt with "
                         "one of nine answer shapes appended, ~31000: for a GPU run); or what earlier corpora drew "
                         "from: wide (xl's first ~1900) or base (its first ~700)")
    checked(di.add_argument("--exclude-prompts-of", nargs="+", metavar="JSONL",
                            help="skip every prompt of these earlier distill corpora, so the new corpus adds "
                                 "prompts instead of repeating them"), existing("file"))
    checked(di.add_argument("--lines", type=int, default=12, help="lines per code snippet (default 12)"),
            at_least(1))
    di.add_argument("--seed", type=int, default=0, help="seed of file order and snippet choice (default 0)")
    di.add_argument("--policy", default="speculative", choices=["ar", "speculative"],
                    help="how to generate (both give AR greedy's tokens; default speculative)")
    checked(di.add_argument("--block-size", type=int, default=2, metavar="D",
                            help="speculative block size, 2..16 (default 2)"), between(2, 16))
    checked(di.add_argument("--adapter", metavar="DIR",
                            help="adapter for speculative generation (default: the shipped one)"), existing("folder"))
    di.add_argument("--engine", default="bitmtp", choices=["bitmtp", "transformers"],
                    help="bitmtp (default): this runtime, one prompt at a time, exactly its AR greedy tokens; "
                         "transformers: the same weights through transformers' batched generate on --device — "
                         "~1.8x faster on a 2-core CPU at --batch-size 64, thousands of prompts a minute on a GPU "
                         "(greedy too; a logit tie within float rounding may break the other way). Needs "
                         "transformers (and gguf for a GGUF model)")
    checked(di.add_argument("--batch-size", type=int, default=64,
                            help="prompts per generate call with --engine transformers (default 64)"), at_least(1))
    di.add_argument("--resume", action="store_true", help="continue from OUT.partial")
    di.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    _model_args(di)
    di.set_defaults(func=_cmd_distill, check=_check_distill)

    ev = sub.add_parser(
        "eval-acceptance", help="mean committed tokens per iteration, per policy and block size",
        description="Generate with AR and with each policy/block size on a prompt set and report the mean "
                    "committed tokens per iteration (and histogram), the verifier rate, tokens/s and speedup "
                    "over AR on the same runtime, and for unverified policies the fraction of output identical "
                    "to AR.")
    _eval_args(ev, prompts=["code", "chat"], count=12, policies="speculative,hybrid", blocks="8")
    ev.set_defaults(func=_cmd_eval)

    be = sub.add_parser(
        "bench", help="AR vs each policy on a prompt set: a table and optionally a PNG plot",
        description="Speed of every policy and block size against AR on the same runtime (tokens/s ratio, "
                    "median over prompts), with committed tokens per iteration and verifier rate. The same "
                    "measurement as eval-acceptance with speed-oriented defaults; --plot saves a chart.")
    _eval_args(be, prompts=["chat"], count=6, policies="speculative,hybrid,confidence", blocks="4,8")
    be.set_defaults(func=_cmd_eval)
