"""Chat drafts on a lent GPU (issue "MTP that pays", item 3): distil many prompts with transformers' batched
``generate``, continue the shipped mask-block adapter on them, and write the adapter and the compressed corpus
to an output folder — one prepared run, sized to a device call's ten minutes.

Why a GPU: held out, the first mask row gains ~0.035 per doubling of distinct prompts (docs/training.md, "Self-
distillation corpora"); reaching 0.6 on eval-acceptance's chat set needs ~10x the ~2400 general prompts the
shipped adapter saw — hours of this project's 2-core CPU, minutes of an H200.

Stages (each bounded in time, each reported on stderr):

1. the prompts of ``python -m bitmtp distill --general-pool xxl`` (minus earlier corpora's) through transformers'
   batched ``generate`` on DEVICE, in length-sorted batches run in random order until ``--distill-seconds``;
2. two short probe runs of :func:`bitmtp.train.train` to measure seconds per step, then the real run with
   ``max_steps`` sized to ``--train-seconds`` (so the cosine schedule ends where the time does);
3. the corpus xz-compressed in parts of at most 15 MiB to ``OUT/`` (before training, so a cut run keeps it),
   the adapter to ``OUT/adapter/``, ``OUT/summary.json``.

Run here (CPU, tiny sizes) to check it before spending device time::

    python bench/gpu_chat_drafts.py --device cpu --count 24 --batch-size 8 --new-tokens 32 \
        --distill-seconds 120 --train-seconds 30 --train-batch 2 --out /tmp/cd

On the device, see ``bench/gpu_chat_drafts.sh`` (model carried in two parts, unpacked under /tmp).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import time
from pathlib import Path

# run as a script, bench/ would lead sys.path and its `kernels` package would shadow the `kernels` package
# transformers imports: the repository root instead
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

SHIPPED = Path(__file__).resolve().parents[1] / "bitmtp" / "adapters" / "smollm2-135m-instruct-mask-block-d8"
PART_BYTES = 15 * 2**20


def log(msg: str) -> None:
    print(f"[chat-drafts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def length_batches(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """:func:`bitmtp.train.distill.length_sorted_batches` over the whole prompt set (a decode step's cost follows
    the batch's padded width: sorting doubled run 1's 5.7 k tok/s on the H200), the batches in a seeded random
    order so a run cut by its time limit still holds general and code prompts alike."""
    import random

    from bitmtp.train.distill import length_sorted_batches

    batches = length_sorted_batches(lengths, batch_size)
    random.Random(seed).shuffle(batches)
    return batches


def distill(args: argparse.Namespace, corpus: Path) -> None:
    """Greedy records of the prompts ``distill --general-pool xxl`` would make (minus ``--exclude-corpus``'s),
    through transformers' batched generate: prompts sorted by length into batches (little left padding: a
    decode step's cost grows with the padded width), the batches run in a seeded random order so a run cut by
    ``--distill-seconds`` still holds a mix of general and code prompts."""
    import bitmtp
    from bitmtp.cli_common import default_model_path
    from bitmtp.cli_train import _load_transformers
    from bitmtp.train.distill import corpus_prompts, distill_prompt_ids, hf_greedy

    t0 = time.perf_counter()
    path = args.model or default_model_path()
    model = bitmtp.load(path, capacity=1024, device="cpu", adapter=None)  # tokenizer, template, end ids
    exclude = corpus_prompts(args.exclude_corpus or [])
    prompts = distill_prompt_ids(model, ["stdlib"], args.count, chat_fraction=0.25, seed=args.seed,
                                 general_fraction=args.general_fraction, general_pool="xxl", exclude=exclude)
    batches = length_batches([len(p) for p in prompts], args.batch_size, args.seed)
    hf = _load_transformers(path, args.device)
    eos = model.eos_ids(None)
    log(f"distill: {len(prompts)} prompts ({len(exclude)} excluded) in {len(batches)} batches of "
        f"<= {args.batch_size}, model ready after {time.perf_counter() - t0:.0f} s")
    n_rec = n_gen = 0
    with corpus.open("w", encoding="utf-8") as fh:
        for b, batch in enumerate(batches):
            if time.perf_counter() - t0 > args.distill_seconds:
                log(f"distill: time limit after {b} of {len(batches)} batches")
                break
            tb = time.perf_counter()
            gens = hf_greedy(hf, [prompts[i] for i in batch], max_new_tokens=args.new_tokens, eos_ids=eos)
            for i, gen in zip(batch, gens, strict=True):
                fh.write(json.dumps({"tokens": prompts[i] + gen, "prompt_tokens": len(prompts[i])}) + "\n")
                n_gen += len(gen)
            n_rec += len(batch)
            log(f"distill: batch {b}: {len(batch)} prompts of {len(prompts[batch[0]])}-{len(prompts[batch[-1]])} "
                f"tokens, {time.perf_counter() - tb:.1f} s")
    del hf
    dt = time.perf_counter() - t0
    log(f"distill: {n_rec} records, {n_gen} generated tokens in {dt:.0f} s ({n_gen / dt:.0f} tok/s with model load)")


def train_adapter(args: argparse.Namespace, corpus: Path, out: Path) -> dict:
    import torch

    import bitmtp
    from bitmtp.cli_common import default_model_path
    from bitmtp.train import TrainConfig, train
    from bitmtp.train.data import training_windows

    model = bitmtp.load(args.model or default_model_path(), capacity=1024, device=args.device, adapter=None)
    decoder = model.decoder
    eos = model.args.eos_token_id[0] if model.args.eos_token_id else None
    sources = [str(corpus)] + list(args.extra_corpus or [])
    # --answer-only: whole records, blocks on answer tokens only (BENCHMARKS, session 16)
    windows, masks = training_windows(sources, model.tokenizer, 256, answer_only=args.answer_only,
                                      max_context=model.args.max_position_embeddings, eos_token_id=eos,
                                      split="train", shuffle_seed=args.seed, vocab_size=model.args.vocab_size)
    log(f"train: {len(windows)} windows of 256 tokens")
    common = dict(mode="mask-block", block_size=8, rank=args.rank, anchors=16, short_anchors=160, soft_targets=0.5,
                  gamma=0.6, seq_len=256, batch_size=args.train_batch, init_from=args.init_from, seed=args.seed,
                  checkpoint_every=0, overwrite=True, save_dtype="float16", answer_only=args.answer_only)
    # two probes: the first pays CUDA's start-up (run 1 sized from one probe: 823 ms a step, then 290 ms a step)
    short, long_ = (train(decoder, windows, TrainConfig(out="/tmp/chat_drafts_probe", lr=args.lr, max_steps=n,
                                                        **common), progress=False, anchor_masks=masks)
                      for n in (2, 8))
    per_step = (long_.seconds - short.seconds) / 6
    if per_step <= 0.1 * long_.seconds / 8:  # start-up noise swamped the difference (run 2: "1 ms a step")
        per_step = long_.seconds / 8
    steps = max(20, int(args.train_seconds / per_step))
    epochs = steps * args.train_batch / len(windows)
    log(f"train: probe {per_step * 1000:.0f} ms a step of {args.train_batch} windows -> {steps} steps "
        f"({epochs:.2f} epochs)")
    cfg = TrainConfig(out=str(out / "adapter"), lr=args.lr, max_steps=steps,
                      time_budget=args.train_seconds * 1.1, **common)
    names = " + ".join(Path(x).name for x in sources)
    cfg.data_description = (f"self-distilled JSONL {names} (transformers greedy on {args.device}, "
                            f"{len(windows)} windows of 256 tokens, shuffled with seed {args.seed})")
    res = train(decoder, windows, cfg, progress=args.progress, anchor_masks=masks)
    acc = ", ".join(f"{a:.3f}" for a in res.accuracy)
    log(f"train: {res.steps} steps, {res.tokens} tokens, {res.seconds:.0f} s, final losses "
        f"{sum(res.losses[-20:]) / max(1, len(res.losses[-20:])):.4f}; block accuracy (last 20 steps): {acc}")
    # the first 20 steps' accuracy on windows never seen before is a held-out figure for the start point
    return {"windows": len(windows), "steps": res.steps, "seconds": round(res.seconds, 1),
            "per_step_ms": round(per_step * 1000, 1), "accuracy_last20": res.accuracy,
            "loss_first20": sum(res.losses[:20]) / max(1, len(res.losses[:20])),
            "loss_last20": sum(res.losses[-20:]) / max(1, len(res.losses[-20:])), "device": str(torch.device(
                args.device))}


def compress(corpus: Path, out: Path) -> list[str]:
    """``corpus`` as xz, in parts of at most 15 MiB (a device call returns files of at most 16 MiB)."""
    xz = out / (corpus.name + ".xz")
    if shutil.which("xz"):
        subprocess.run(["xz", "-T0", "-6", "-k", "-c", str(corpus)], check=True, stdout=xz.open("wb"))
    else:
        with corpus.open("rb") as src, lzma.open(xz, "wb", preset=3) as dst:
            shutil.copyfileobj(src, dst)
    data, parts = xz.read_bytes(), []
    xz.unlink()
    for i in range(0, len(data), PART_BYTES):
        part = out / f"{xz.name}.part{i // PART_BYTES:02d}"
        part.write_bytes(data[i:i + PART_BYTES])
        parts.append(part.name)
    return parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="the SmolLM2 GGUF (default: the embedded one)")
    p.add_argument("--out", required=True, help="folder for adapter/, the corpus parts and summary.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--corpus", help="an existing distill corpus: skip stage 1")
    p.add_argument("--exclude-corpus", nargs="+", metavar="JSONL", help="earlier corpora: distil other prompts")
    p.add_argument("--extra-corpus", nargs="+", metavar="JSONL", help="earlier corpora to train on as well")
    p.add_argument("--init-from", default=str(SHIPPED), help="adapter to continue (default: the shipped one)")
    p.add_argument("--count", type=int, default=40000, help="prompts to distil (default 40000)")
    p.add_argument("--general-fraction", type=float, default=0.75,
                   help="general chat prompts, the rest code snippets (default 0.75: keep code in the mix)")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=1024, help="prompts per generate call (default 1024)")
    p.add_argument("--distill-seconds", type=float, default=240)
    p.add_argument("--train-seconds", type=float, default=200)
    p.add_argument("--train-batch", type=int, default=32, help="windows per step (default 32)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16; above the init's, it grows)")
    p.add_argument("--answer-only", action="store_true",
                   help="windows of whole records, blocks anchored on answer tokens only (train --answer-only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="tqdm bar while training")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.corpus:
        corpus = Path(args.corpus)
    else:
        corpus = Path("/tmp/chat_drafts") / f"chat{args.count}.jsonl"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        distill(args, corpus)
    summary = {"args": vars(args)}
    if not args.corpus:  # saved before training: a run cut later still returns its corpus
        summary["corpus_parts"] = compress(corpus, out)
        log(f"corpus: {', '.join(summary['corpus_parts'])}")
    summary["train"] = train_adapter(args, corpus, out)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done in {summary['seconds']:.0f} s: " + json.dumps(summary["train"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
