"""Self-distillation corpora: the base model's own greedy continuations of prompts, as JSONL.

Why: a drafter is judged by what greedy verification accepts, and at inference every token it sees
after the prompt is one the base model generated. ``train``'s self-distillation already makes the
*targets* the base's greedy predictions, but on human-written text the *inputs* (the tokens the
heads are fed, the hidden states they start from) come from another distribution — human code is
less repetitive and less predictable than a 135M model's continuation of it. Training on the
base's own continuations closes that gap (Medusa-2 and EAGLE regenerate their data the same way).

A record is ``{"tokens": [...], "prompt_tokens": n}``: token ids, so nothing is lost to a decode →
re-encode round trip (``bitmtp.train.data`` reads such records as they are). Prompts come from the
training side of a corpus only — for ``stdlib`` the train split, never the held-out files the
evaluation's code prompts come from.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.train.data import iter_python_lines

#: how a chat-style distillation prompt asks about a snippet (several, so no one phrasing dominates)
CHAT_TEMPLATES = (
    "What does this Python code do?\n\n{code}",
    "Explain the following function step by step.\n\n{code}",
    "Suggest an improvement to this code and show it.\n\n{code}",
    "Write a short docstring for this function.\n\n{code}",
)


def snippet_prompts(sources: Iterable[str | Path] = ("stdlib",), count: int = 400, *, lines: int = 12,
                    per_file: int = 3, seed: int = 0) -> list[str]:
    """Up to ``count`` code snippets: ``lines`` lines from a ``def`` on, at most ``per_file`` per file,
    from the train split of the sources (``.py`` files; a user's own files are used whole)."""
    if count < 1:
        raise BitMTPError(f"count: must be >= 1, got {count}")
    rng = random.Random(seed)
    out: list[str] = []
    for text in iter_python_lines(list(sources), split="train", shuffle_seed=seed):
        starts = [i for i, ln in enumerate(text) if ln.lstrip().startswith("def ")]
        for i in sorted(rng.sample(starts, min(per_file, len(starts)))):
            snippet = "\n".join(text[i : i + lines])
            if len(snippet) >= 40:  # skip near-empty snippets: too little context to continue
                out.append(snippet + "\n")
            if len(out) >= count:
                return out
    if not out:
        raise BitMTPError("data: no Python function found in the sources to build prompts from")
    return out


@dataclass
class DistillStats:
    """What :func:`distill_corpus` wrote."""

    path: Path
    records: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float


def distill_corpus(model: Any, prompts: Sequence[list[int]], out: str | Path, *, max_new_tokens: int = 160,
                   policy: str = "ar", block_size: int | None = None, overwrite: bool = False,
                   resume: bool = False, progress: bool = True) -> DistillStats:
    """Greedy continuations of ``prompts`` (token ids) by ``model`` (a :class:`bitmtp.BitMTPModel`),
    written to the JSONL file ``out``.

    ``policy`` may be any *exact* policy (``ar`` or ``speculative``: both give AR greedy's tokens,
    speculative faster when the model has an adapter). Records go to ``OUT.partial`` line by line and
    the file is renamed to ``out`` at the end, so an interrupted run leaves no half-written ``out``;
    ``resume=True`` keeps the records already in ``OUT.partial`` and continues after them.
    """
    import bitmtp

    if policy not in ("ar", "speculative"):
        raise BitMTPError(f"policy: distillation needs an exact policy (ar or speculative), got {policy!r}")

    def generate(batch: list[list[int]]) -> list[list[int]]:
        return [list(bitmtp.generate(model, input_ids=list(ids), max_new_tokens=max_new_tokens, policy=policy,
                                     block_size=block_size if policy != "ar" else None, eos_token_id=None).token_ids)
                for ids in batch]

    return _write_corpus(prompts, out, generate, batch_size=1, overwrite=overwrite, resume=resume, progress=progress)


def hf_greedy(hf_model: Any, batch: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int],
              pad_id: int = 0) -> list[list[int]]:
    """Greedy continuations of a ``batch`` of prompts (token ids) by a transformers causal LM, in one
    left-padded ``generate`` call: each cut after its first token of ``eos_ids`` (kept, as
    :func:`bitmtp.generate` keeps it) or at ``max_new_tokens``."""
    import torch

    if not batch or any(len(ids) == 0 for ids in batch):
        raise BitMTPError("prompts: every prompt needs at least one token")
    width = max(len(ids) for ids in batch)
    dev = next(hf_model.parameters()).device
    inputs = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in batch], device=dev)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=dev)
    from transformers import GenerationConfig

    # the checkpoint's generation_config is set aside for the call: a repetition penalty or n-gram block stored
    # there would make this something other than plain greedy decoding, and transformers fills the values a
    # passed config leaves at their defaults from it
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad_id,
                              eos_token_id=list(eos_ids))
    saved = hf_model.generation_config
    hf_model.generation_config = config
    try:
        with torch.no_grad():
            out = hf_model.generate(input_ids=inputs, attention_mask=mask, generation_config=config)
    finally:
        hf_model.generation_config = saved
    eos = set(int(e) for e in eos_ids)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices ``0..len(lengths)-1`` sorted by length (stable), in batches of ``batch_size``: batches of similar
    lengths, so left padding to each batch's longest prompt costs little."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[lo:lo + batch_size] for lo in range(0, len(order), batch_size)]


#: batches per length-sorted chunk of :func:`distill_corpus_hf` (records are written a chunk at a time)
SORT_CHUNK = 8


def distill_corpus_hf(hf_model: Any, prompts: Sequence[list[int]], out: str | Path, *, eos_ids: Sequence[int],
                      max_new_tokens: int = 160, batch_size: int = 64, overwrite: bool = False,
                      resume: bool = False, progress: bool = True) -> DistillStats:
    """:func:`distill_corpus` through transformers' batched ``generate`` (``hf_model``: the same weights as a
    transformers causal LM, on any device): ``batch_size`` prompts per call, so a GPU distils thousands of
    prompts a minute where bitmtp's engine decodes one sequence at a time. The tokens are the same greedy
    continuations up to float rounding: where two logits tie within it the two may choose differently (the
    records then are the transformers model's greedy output — fine for training data, not for exactness
    tests). Same file format, ``OUT.partial`` and ``resume`` rules.

    The prompts go in chunks of ``SORT_CHUNK`` batches: a chunk's prompts are sorted by length into its batches (a
    batch is left-padded to its longest prompt, and each decode step's cost follows that width: length-sorted
    batches doubled the H200's throughput, 5.7 → 11 k tok/s at batch 1024) and its records written in the prompts'
    own order, so the file and ``resume`` are as without sorting."""
    if batch_size < 1:
        raise BitMTPError(f"batch_size: must be >= 1, got {batch_size}")
    if not eos_ids:
        raise BitMTPError("eos_ids: the model's end-of-sequence ids are needed to cut the continuations")

    def generate(chunk: list[list[int]]) -> list[list[int]]:
        rows: list[list[int]] = [[] for _ in chunk]
        for idx in length_sorted_batches([len(p) for p in chunk], batch_size):
            gens = hf_greedy(hf_model, [chunk[i] for i in idx], max_new_tokens=max_new_tokens, eos_ids=eos_ids)
            for i, gen in zip(idx, gens, strict=True):
                rows[i] = gen
        return rows

    return _write_corpus(prompts, out, generate, batch_size=batch_size * SORT_CHUNK, overwrite=overwrite,
                         resume=resume, progress=progress)


def _write_corpus(prompts: Sequence[list[int]], out: str | Path, generate, *, batch_size: int, overwrite: bool,
                  resume: bool, progress: bool) -> DistillStats:
    """Records ``{"tokens": prompt + generate(prompt), "prompt_tokens": n}`` into ``OUT.partial`` (``batch_size``
    prompts per ``generate`` call, each record flushed as it is written), renamed to ``out`` at the end."""
    import time

    out = Path(out)
    if not prompts:
        raise BitMTPError("prompts: the prompt set is empty")
    if out.exists() and not overwrite:
        raise BitMTPError(f"out: {out} exists; pass overwrite=True (--overwrite) to replace it")
    partial = out.with_name(out.name + ".partial")
    done = 0
    if resume and partial.exists():
        done = _resume_partial(partial)
    elif partial.exists():
        partial.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), initial=min(done, len(prompts)), desc="distill", unit="prompt")
    start = time.perf_counter()
    todo = list(prompts[done:])
    with partial.open("a", encoding="utf-8") as fh:
        for lo in range(0, len(todo), batch_size):
            batch = [list(ids) for ids in todo[lo:lo + batch_size]]
            for ids, gen in zip(batch, generate(batch), strict=True):
                fh.write(json.dumps({"tokens": ids + list(gen), "prompt_tokens": len(ids)}) + "\n")
                fh.flush()
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    n_rec = n_prompt = n_gen = 0
    for line in partial.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            n_rec += 1
            n_prompt += rec["prompt_tokens"]
            n_gen += len(rec["tokens"]) - rec["prompt_tokens"]
    os.replace(partial, out)
    return DistillStats(out, n_rec, n_prompt, n_gen, time.perf_counter() - start)


def _check_record(line: str) -> bool:
    """Whether ``line`` is one distillation record: ``{"tokens": [ints], "prompt_tokens": int}``."""
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return (isinstance(rec, dict) and isinstance(rec.get("tokens"), list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in rec["tokens"])
            and isinstance(rec.get("prompt_tokens"), int) and 0 <= rec["prompt_tokens"] <= len(rec["tokens"]))


def _resume_partial(partial: Path) -> int:
    """The records already in ``partial`` (``--resume``). A run killed mid-write leaves a last line
    without its newline: it is cut off (that prompt runs again) so the next record starts on a line of
    its own. Any other line that is not a record means the file is not this run's: an error."""
    data = partial.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # up to the last newline; b"" when there is none
    try:
        lines = complete.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise BitMTPError(f"resume (--resume): {partial} is not UTF-8 JSONL; delete it and run without --resume "
                          f"to start over") from None
    done = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not _check_record(line):
            raise BitMTPError(f"resume (--resume): line {i} of {partial} is not a distillation record "
                              f"({{\"tokens\": [...], \"prompt_tokens\": n}}); delete it and run without --resume "
                              f"to start over")
        done += 1
    if len(complete) < len(data):
        with partial.open("r+b") as fh:
            fh.truncate(len(complete))
    return done


def distill_prompt_ids(model: Any, sources: Iterable[str | Path] = ("stdlib",), count: int = 400, *,
                       chat_fraction: float = 0.25, lines: int = 12, seed: int = 0,
                       general_fraction: float = 0.0, general_pool: str = "xl",
                       exclude: Collection[Sequence[int]] = ()) -> list[list[int]]:
    """Token ids of ``count`` distillation prompts: raw code snippets, and a ``chat_fraction`` of them
    asked about through the model's chat template (so the drafts also learn chat answers).

    ``general_fraction`` of the ``count`` prompts are instead general chat questions and instructions
    (:func:`bitmtp.train.chat_prompts.chat_prompts`, chat template), shuffled in among the code ones so
    a partial corpus has both; ``chat_fraction`` applies to the rest. 0 (the default) keeps code only.
    ``general_pool``: which set they come from (``xl``; ``xxl``, ~10× as many for a GPU run; or ``wide`` /
    ``base`` as earlier corpora used).

    ``exclude``: prompts (token ids) to skip — those of corpora already made (:func:`corpus_prompts`),
    so a new corpus adds prompts rather than repeating them: the next prompts in the same seeded order
    take their place. Raises :class:`BitMTPError` when too few prompts are left."""
    if not 0.0 <= chat_fraction <= 1.0:
        raise BitMTPError(f"chat_fraction: must be in [0, 1], got {chat_fraction}")
    if not 0.0 <= general_fraction <= 1.0:
        raise BitMTPError(f"general_fraction: must be in [0, 1], got {general_fraction}")
    if model.tokenizer is None:
        raise BitMTPError("model: building distillation prompts needs the model's tokenizer")
    n_general = round(count * general_fraction)
    skip = {tuple(p) for p in exclude}
    rng = random.Random(seed + 1)
    out = []
    n_code = count - n_general
    if n_code > 0:
        code = []
        # excluded prompts drop out after the draw, so draw as many more as could be excluded
        for snippet in snippet_prompts(sources, n_code + len(skip), lines=lines, seed=seed):
            if rng.random() < chat_fraction:
                text = rng.choice(CHAT_TEMPLATES).format(code=snippet)
                ids = model.encode([{"role": "user", "content": text}])
            else:
                ids = model.encode(snippet)
            if tuple(ids) not in skip:
                code.append(ids)
            if len(code) == n_code:
                break
        if skip and len(code) < n_code:
            raise BitMTPError(f"exclude: only {len(code)} code prompts of the sources are not in the excluded "
                              f"corpora, {n_code} asked for; lower --count, raise --general-fraction, or add --data "
                              f"sources")
        out += code
    if n_general:
        from bitmtp.train.chat_prompts import chat_prompts

        # the whole pool in chat_prompts' seeded order, encoded only until enough are found
        pool = chat_prompts(None, seed=seed, pool=general_pool)
        encoded = (model.encode([{"role": "user", "content": q}]) for q in pool)
        general = list(itertools.islice((ids for ids in encoded if tuple(ids) not in skip), n_general))
        if len(general) < n_general:
            raise BitMTPError(f"general_fraction: the {general_pool!r} general prompt pool has {len(general)} prompts "
                              f"not in the excluded corpora, {n_general} asked for; lower --count or "
                              f"--general-fraction" + ("" if general_pool == "xl" else ", or use the xl pool"))
        out += general
        random.Random(seed + 2).shuffle(out)
    return out


def corpus_prompts(paths: Iterable[str | Path]) -> list[list[int]]:
    """The prompts (token ids) of distillation corpora: each record's first ``prompt_tokens`` tokens.

    Raises :class:`BitMTPError` for a missing or unreadable file or a line that is not a record."""
    out = []
    for path in map(Path, paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BitMTPError(f"exclude: cannot read {path} as a UTF-8 distillation corpus "
                              f"({type(exc).__name__})") from None
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if not _check_record(line):
                raise BitMTPError(f"exclude: line {i} of {path} is not a distillation record "
                                  f"({{\"tokens\": [...], \"prompt_tokens\": n}})")
            rec = json.loads(line)
            out.append(rec["tokens"][: rec["prompt_tokens"]])
    return out
