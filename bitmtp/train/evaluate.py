"""Acceptance evaluation: what an adapter delivers per policy and block size on a prompt set.

For each (policy, D): mean committed tokens per iteration and their histogram, verifier rate,
decode tokens/s and its ratio to AR on the same engine, and — for the unverified policies
(confidence, hybrid) — the fraction of generated tokens identical to AR greedy's (position by
position up to the first difference, averaged over prompts). For ``speculative`` rows, also the
acceptance of each drafted position (:func:`position_acceptance`; one-pass schedules:
:func:`onepass_position_acceptance`): how often mask row k's draft was accepted, given the verifier got
to check it.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.train.data import iter_python_lines
from bitmtp.train.long_docs import document_prompts

#: chat prompts for evaluation (held out: the general training prompts exclude their topics); package data,
#: ``bitmtp/data/eval_prompts.json``
CHAT_PROMPTS: list[str] = json.loads(
    (files("bitmtp") / "data" / "eval_prompts.json").read_text(encoding="utf-8"))["chat"]


def code_prompts(count: int = 12, lines: int = 12, seed: int = 0) -> list[str]:
    """Held-out code prompts: the first ``lines`` lines of a function from standard-library files of the
    held-out split (``bitmtp.train.data.is_heldout``), which training never sees."""
    out = []
    for text in iter_python_lines(["stdlib"], split="heldout", shuffle_seed=seed):
        starts = [i for i, ln in enumerate(text) if ln.startswith("def ") or ln.startswith("    def ")]
        if not starts:
            continue
        i = starts[len(starts) // 2]
        snippet = "\n".join(text[i : i + lines])
        if len(snippet) > 80:
            out.append(snippet + "\n")
        if len(out) >= count:
            break
    return out


@dataclass
class AcceptanceRow:
    policy: str
    block_size: int
    prompts: int
    mean_committed: float
    histogram: dict[int, int]
    verifier_rate: float
    tokens_per_second: float
    speedup_vs_ar: float
    identical_to_ar: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    #: speculative rows: acceptance of drafted positions d_2..d_D (:func:`position_acceptance`); else None
    position_acceptance: list[float] | None = None
    #: how many drafts each of those rates was measured on (position k: the iterations that checked it)
    position_checked: list[int] | None = None


def position_acceptance(runs: list[tuple[list[int], list[bool]]], block_size: int
                        ) -> tuple[list[float], list[int]]:
    """Per drafted position k = 1..D-1 (d_2..d_D, the mask rows), the fraction of verified iterations
    whose draft at k was accepted among those that checked it (all drafts before k accepted), and the
    count checked; a position never checked gets NaN.

    ``runs``: per generation, ``(committed, verified)`` of its ``DecodeStats``. It reads a speculative
    (two-pass) iteration as committing d_1 (exact: the AR prediction), its accepted mask drafts, then
    the verifier's own token: ``committed = 2 + accepted``. A generation's last iteration is left out
    (``max_new_tokens`` may cut it short, which would read as a rejection), as are unverified ones.
    """
    if block_size < 2:
        raise BitMTPError(f"block_size: drafted positions need D >= 2, got {block_size}")
    checked = [0] * (block_size - 1)
    accepted = [0] * (block_size - 1)
    for committed, verified in runs:
        for c, v in list(zip(committed, verified, strict=True))[:-1]:
            if not v:
                continue
            if not 2 <= c <= block_size + 1:
                raise BitMTPError(f"committed: a verified speculative iteration at D={block_size} commits "
                                  f"2..{block_size + 1} tokens, got {c}; position acceptance applies to "
                                  f"two-pass speculative decoding only")
            a = c - 2
            for k in range(min(a + 1, block_size - 1)):  # checked: position k+1 (every draft before it accepted)
                checked[k] += 1
                accepted[k] += k < a
    return [a / c if c else float("nan") for a, c in zip(accepted, checked, strict=True)], checked


def onepass_position_acceptance(stats: list, block_size: int) -> tuple[list[float], list[int]]:
    """:func:`position_acceptance` for the one-pass schedules, from each generation's ``DecodeStats``
    ``position_checked`` / ``position_accepted``: per guess position k = 1..D − 1 (g_k, drafted by mask row
    k of the step before — the same mask rows as a two-pass draft's d_2..d_D), the fraction accepted among
    the steps that checked it. Under ``schedule="top2"`` position 1 counts as accepted when g_1 or its
    runner-up is (the step verifies both)."""
    if block_size < 2:
        raise BitMTPError(f"block_size: drafted positions need D >= 2, got {block_size}")
    checked = [0] * (block_size - 1)
    accepted = [0] * (block_size - 1)
    for st in stats:
        if len(st.position_checked) > block_size - 1:
            raise BitMTPError(f"stats: {len(st.position_checked)} guess positions at D={block_size}; a one-pass "
                              f"step verifies at most D - 1 guesses")
        for k, (c, a) in enumerate(zip(st.position_checked, st.position_accepted, strict=True)):
            checked[k] += c
            accepted[k] += a
    return [a / c if c else float("nan") for a, c in zip(accepted, checked, strict=True)], checked


def _prefix_match(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / max(1, len(b))


def evaluate_acceptance(model, prompts: list[list[int]], *, policies=("speculative", "hybrid"), block_sizes=(8,),
                        max_new_tokens: int = 64, tau: float = 0.9, min_prefix: int | None = None,
                        stop_at_eos: bool = False, progress: bool = True,
                        schedule: str | None = None) -> list[AcceptanceRow]:
    """Run AR and each (policy, D) over ``prompts`` (token ids) on ``model`` (with its adapter).

    ``policies``: registered policy names (``bitmtp.decoding.policy_names()``), with the loose ``tau``
    and ``min_prefix`` each takes. The "identical to AR" column is left out for lossless policies.
    Every generation runs ``max_new_tokens`` past any end-of-sequence token (the same count per prompt, the
    figures recorded so far) unless ``stop_at_eos``: then each stops at the model's end ids, as a user's
    generation does — a short chat answer then adds no drafts of the text the model makes up after it.
    ``schedule``: ``speculative``'s schedule (None: two-pass; ``bitmtp.decoding.policies.SCHEDULES``), e.g.
    ``"top2"`` to count a first drafted position accepted when the mask row's first or second choice is."""
    import bitmtp
    from bitmtp.decoding import get_policy

    if not prompts:
        raise BitMTPError("prompts: the prompt set is empty")
    from bitmtp.decoding.policies import ONE_PASS_SCHEDULES, check_schedule

    lossless = {p: get_policy(p).lossless for p in policies}  # unknown names fail here, before any work
    check_schedule(schedule)
    if schedule is not None and list(policies) != ["speculative"]:
        raise BitMTPError(f"schedule: applies to the speculative policy only; evaluate --policies speculative with "
                          f"--schedule {schedule}, got policies {', '.join(policies)}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts) * (1 + len(policies) * len(block_sizes)), desc="eval-acceptance", unit="gen")
    eos = None if stop_at_eos else []  # None: the model's own end ids
    ar, ar_tps = [], []
    for ids in prompts:
        res = bitmtp.generate(model, input_ids=ids, max_new_tokens=max_new_tokens, policy="ar", eos_token_id=eos)
        ar.append(res.token_ids)
        ar_tps.append(res.stats.tokens_per_second)
        if bar is not None:
            bar.update(1)
    rows = []
    for policy in policies:
        for d in block_sizes:
            committed: list[int] = []
            ver, iters, tps, same, ratio, all_stats = 0, 0, [], [], [], []
            for ids, ref, base_tps in zip(prompts, ar, ar_tps, strict=True):
                res = bitmtp.generate(model, input_ids=ids, max_new_tokens=max_new_tokens, policy=policy,
                                      block_size=d, tau=tau, min_prefix=min_prefix, eos_token_id=eos,
                                      schedule=schedule)
                all_stats.append(res.stats)
                committed += res.stats.committed
                ver += res.stats.verifier_calls
                iters += res.stats.iterations
                tps.append(res.stats.tokens_per_second)
                ratio.append(res.stats.tokens_per_second / base_tps)
                same.append(_prefix_match(res.token_ids, ref))
                if bar is not None:
                    bar.update(1)
            pos, pos_n = None, None
            if policy == "speculative":
                pos, pos_n = (onepass_position_acceptance(all_stats, d) if schedule in ONE_PASS_SCHEDULES
                              else position_acceptance([(s.committed, s.verified) for s in all_stats], d))
            rows.append(AcceptanceRow(
                policy, d, len(prompts), sum(committed) / max(1, len(committed)),
                dict(sorted(Counter(committed).items())), ver / max(1, iters), statistics.median(tps),
                statistics.median(ratio), None if lossless[policy] else statistics.mean(same),
                position_acceptance=pos, position_checked=pos_n))
    if bar is not None:
        bar.close()
    return rows


def format_table(rows: list[AcceptanceRow], title: str = "") -> str:
    """A Markdown table of ``rows``; "accepted d_2..d_D" lists the per-position acceptance (speculative)."""
    head = ("| prompts | policy | D | mean committed/iter | verifier rate | tok/s | speedup vs AR | identical to AR "
            "| accepted d_2..d_D |")
    lines = ([f"**{title}**", ""] if title else []) + [head, "|" + "---|" * 9]
    for r in rows:
        same = "exact (verified)" if r.identical_to_ar is None else f"{r.identical_to_ar:.0%}"
        pos = " ".join(f"{a:.2f}" for a in r.position_acceptance) if r.position_acceptance else "-"
        lines.append(f"| {r.prompts} | {r.policy} | {r.block_size} | {r.mean_committed:.2f} | {r.verifier_rate:.2f} | "
                     f"{r.tokens_per_second:.1f} | {r.speedup_vs_ar:.2f}x | {same} | {pos} |")
    return "\n".join(lines)


def prompt_ids(model, kind: str, count: int) -> list[list[int]]:
    """Token ids of a named prompt set: ``code`` (held-out stdlib functions, raw text), ``chat`` (chat
    template), ``docs`` (held-out long documents of 500–1500 tokens, each followed by a request about
    it: ``bitmtp.train.long_docs``; chat template; prompts of up to ~1550 tokens, so load the model with
    a capacity of 2048) or a path to a text file with one prompt per line (chat template)."""
    if model.tokenizer is None:
        raise BitMTPError("prompts: evaluating named prompt sets needs the model's tokenizer")
    if kind == "code":
        return [model.encode(p) for p in code_prompts(count)]
    if kind == "docs":
        return [model.encode(messages) for messages in document_prompts(count)]
    if kind == "chat":
        texts = CHAT_PROMPTS[:count]
    else:
        path = Path(kind)
        if not path.is_file():
            raise BitMTPError(f"prompts: expected 'code', 'chat', 'docs' or a text file, got {kind!r}")
        texts = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()][:count]
    return [model.encode([{"role": "user", "content": t}]) for t in texts]
