#!/usr/bin/env python
"""Mutation check: break the library on purpose, one mutant at a time, and make sure a test notices.

Each mutant names a source file, an exact snippet in it (one of a few alternatives: the first that
occurs exactly once is used), its replacement, and the tests that must catch it. For every mutant
the script copies the repository to a temporary folder (never touching the working tree), applies
the one edit there, and runs only the named tests with ``-x`` against the copy, using this venv's
interpreter. A mutant is *caught* when pytest fails (or the run times out); it *survives* when the
named tests pass. A mutant whose snippet is missing (the code changed under it) is *stale*: the list
must be updated, and it counts as a failure too, so the check cannot rot into passing silently.

Before the mutants, the union of the named tests runs once on the unmutated copy: a test that fails
anyway would "catch" every mutant and prove nothing (``--no-baseline`` skips this).

Usage (docs/MUTATION.md)::

    python scripts/mutate.py              # every mutant; exit 1 if any survives or is stale
    python scripts/mutate.py --list       # the mutants and their tests
    python scripts/mutate.py -k bonus     # mutants whose name contains "bonus"
    python scripts/mutate.py --jobs 2     # two mutants at a time (each in its own copy)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug: in ``file`` replace ``original`` (or the first of ``alternatives`` found
    exactly once) by ``replacement``; ``tests`` (pytest arguments: node ids, files, ``-k`` expressions)
    must fail on it."""

    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str = ""
    alternatives: tuple[tuple[str, str], ...] = ()

    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.original, self.replacement),) + self.alternatives


MTP = "tests/runtime/test_decode.py"
QUICK = f"{MTP}::test_quick_lossless_bonus_and_stops"
SPEC_SUBSET = (QUICK,)

MUTANTS: tuple[Mutant, ...] = (
    # -- decoding: what an iteration commits ---------------------------------------------------------
    Mutant("confidence-reverses-d2..dD", "bitmtp/runtime/two_pass.py",
           "commit = policy.commit(draft, probs, None)",
           "commit = policy.commit(draft[:1] + draft[:0:-1], probs, None)",
           (MTP, "-k", "independent_draft"), "unverified commits beyond d_1 in the wrong order"),
    Mutant("drop-bonus-token", "bitmtp/decoding/policies.py",
           "return Commit(tuple(int(t) for t in draft[:a]) + (int(verify[a - 1]),), exact_rows=a, verified=True)",
           "return Commit(tuple(int(t) for t in draft[:a]), exact_rows=a - 1, verified=True)",
           (QUICK,),
           "speculative commits d_1..d_a without the verifier's v_a (still lossless, one token fewer)"),
    Mutant("one-pass-accepts-past-a-mismatch", "bitmtp/runtime/decode.py",
           "    a = speculative_accept([v[0], *layout.guesses], v[: layout.k + 1]) - 1",
           "    a = min(layout.k, speculative_accept([v[0], *layout.guesses], v[: layout.k + 1]))",
           ("tests/runtime/test_onepass.py",), "one pass accepts one guess past the first rejected one"),
    Mutant("one-pass-mask-guesses-shifted", "bitmtp/runtime/pass_layouts.py",
           "return v[self.r0 : self.width], p[self.r0 : self.width], second",
           "return v[self.r0 - 1 : self.width - 1], p[self.r0 : self.width], second",
           ("tests/runtime/test_onepass.py", "-k", "independent_draft_step"),
           "a fused step hands the next iteration its mask drafts one position early (lossless, slower)"),
    Mutant("heads-draft-from-the-last-row", "bitmtp/decoding/drafters.py",
           "a = torch.cumprod(match, 0).sum().reshape(1) if p > 1",
           "a = match.sum().reshape(1) if p > 1",
           ("tests/runtime/test_onepass.py", "-k", "heads_drafts_follow"),
           "one-pass heads count matching guesses past a mismatch: drafts from the wrong row (lossless, slower)"),
    Mutant("tree-block-sees-the-next-guess", "bitmtp/decoding/onepass.py",
           "            anchor.append(b)",
           "            anchor.append(min(b + 1, k))",
           ("tests/runtime/test_onepass.py", "-k", "tree_drafts"),
           "a tree's mask block after g_b also attends g_(b+1): drafts no draft step would make (lossless, slower)"),
    Mutant("tree-scratch-over-block-k", "bitmtp/decoding/onepass.py",
           "        first = k + 1 if b == k else k + d + b * (d - 1)",
           "        first = k + 1 if b == k else k + 1 + b * (d - 1)",
           ("tests/runtime/test_onepass.py", "-k", "tree"),
           "a tree's scratch slots overlap the last block's rows: two rows write one KV slot"),
    Mutant("top2-runner-up-slot-off-lane", "bitmtp/decoding/onepass.py",
           "    return 1 + ATTENTION_LANES * -(-(p + d - 2) // ATTENTION_LANES)",
           "    return p + d - 1",
           ("tests/runtime/test_onepass.py", "-k", "top2_forced"),
           "the runner-up's scratch slot right after the step's rows: its attention sums in other lanes, so its "
           "moved KV row is not AR's bits"),
    Mutant("top2-runner-up-sees-g1", "bitmtp/decoding/drafters.py",
           "alt = (runner.kv_index <= n) | (runner.kv_index == runner.slots[p : p + 1])",
           "alt = (runner.kv_index <= n + 1) | (runner.kv_index == runner.slots[p : p + 1])",
           ("tests/runtime/test_onepass.py", "-k", "top2_forced"),
           "the runner-up row also attends g_1's KV row (same position): it commits a token AR would not"),
    Mutant("top2-no-kv-move", "bitmtp/runtime/pass_layouts.py",
           "        kv.move_row(self.alt_slot, self.n + 1)",
           "        kv.rows_copied += 1",
           ("tests/runtime/test_onepass.py", "-k", "top2_forced"),
           "an accepted runner-up commits but its KV row stays in the scratch slot: position n + 1 keeps g_1's"),
    Mutant("top2-third-choice", "bitmtp/decoding/drafters.py",
           "runner.out_second.copy_(logits[st.pending + st.alt - lo].topk(2).indices[1:])",
           "runner.out_second.copy_(logits[st.pending + st.alt - lo].topk(3).indices[2:])",
           ("tests/runtime/test_onepass.py", "-k", "second_choice"),
           "the runner-up is the mask row's third choice (lossless, fewer accepted)"),
    Mutant("lookup-earliest-occurrence", "bitmtp/decoding/lookup.py",
           "                maps[n][tuple(seq[i - n : i])] = i",
           "                maps[n].setdefault(tuple(seq[i - n : i]), i)",
           ("tests/decoding/test_lookup.py",), "lookup continues the earliest occurrence instead of the latest"),
    Mutant("tau-boundary-p<=tau", "bitmtp/decoding/policies.py",
           "if not p >= tau:", "if not p > tau:",
           ("tests/decoding/test_policies.py",), "a probability exactly at tau no longer counts as confident",
           alternatives=(("if p < tau:", "if p <= tau:"),)),
    Mutant("nan-probability-confident", "bitmtp/decoding/policies.py",
           "if not p >= tau:", "if p < tau:",
           ("tests/decoding/test_policies.py",), "NaN draft probabilities count as confident (issue 21)"),
    Mutant("speculative-accept-off-by-one", "bitmtp/decoding/accept.py",
           "agree = (draft[..., 1:] == verify[..., :-1]).long()",
           "agree = (draft[..., 1:] == verify[..., 1:]).long()",
           ("tests/decoding/test_policies.py", *SPEC_SUBSET), "d_(i+1) compared with v_(i+1) instead of v_i"),
    Mutant("speculative-accept-host-off-by-one", "bitmtp/decoding/accept.py",
           "while a < len(draft) and int(draft[a]) == int(verify[a - 1]):",
           "while a < len(draft) and int(draft[a]) == int(verify[min(a, len(verify) - 1)]):",
           ("tests/decoding/test_policies.py",), "the host mirror compares d_(i+1) with v_(i+1) instead of v_i"),
    Mutant("hybrid-ignores-d1", "bitmtp/decoding/policies.py",
           "return max(1, h) < min_prefix", "return h < min_prefix",
           (f"{MTP}::test_hybrid_limits", "tests/decoding/test_policies.py"),
           "hybrid's confident prefix not counting d_1 (m = 1 would verify)"),
    # -- runtime: KV bookkeeping, masks, verifier prep -----------------------------------------------
    Mutant("kv-n-not-advanced-after-verify", "bitmtp/runtime/two_pass.py",
           "n += commit.exact_rows", "n += 0",
           (*SPEC_SUBSET,), "accepted rows of a verify step not counted as materialized"),
    Mutant("kv-n-not-advanced-after-deferred-verify", "bitmtp/runtime/two_pass.py",
           "n = deferred.n + commit.exact_rows", "n = deferred.n",
           (f"{MTP}::test_hybrid_verified_iterations_are_ar_exact",),
           "hybrid's device-resolved verify: accepted rows not counted"),
    Mutant("causal-mask-sees-only-its-own-key", "bitmtp/runtime/graphs.py",
           "StepInputsFill(self.pos, None, self.pos,", "StepInputsFill(self.pos, self.pos, self.pos,",
           ("tests/model/test_vs_transformers.py", "-k", "engine_greedy"), "a row sees its own key only"),
    Mutant("step-inputs-reference-off-by-one", "bitmtp/ops/step_inputs.py",
           "np.less_equal(index[None, :], hi[:, None], out=mask)", "np.less(index[None, :], hi[:, None], out=mask)",
           ("tests/ops/test_step_inputs.py",), "the numpy mask (no extension) hides a row's own key"),
    Mutant("causal-mask-off-by-one-off-the-cpu", "bitmtp/runtime/graphs.py",
           "return kv_index[None, :] <= positions[:, None]", "return kv_index[None, :] < positions[:, None]",
           ("tests/runtime/test_host_inputs.py", "-k", "causal"),
           "on a GPU (the torch causal mask) a row cannot see its own key"),
    Mutant("pending-rows-mask-off-by-one", "bitmtp/decoding/drafters.py",
           "mask = runner.kv_index[None, :] <= pos[:, None]", "mask = runner.kv_index[None, :] <= pos[:, None] - 1",
           (*SPEC_SUBSET,), "the heads drafter's pending rows miss their own key"),
    Mutant("mask-rows-not-bidirectional", "bitmtp/decoding/drafters.py",
           "reach = torch.where(torch.arange(pos.shape[0], device=pos.device) < runner.state.pending, pos, pos[-1])",
           "reach = pos",
           (MTP, "-k", "independent_draft and mask-block"), "mask rows attend causally inside their block"),
    Mutant("heads-always-head-0", "bitmtp/decoding/drafters.py",
           "state = self.heads.step(k, state, self.decoder.embed[tok])",
           "state = self.heads.step(0, state, self.decoder.embed[tok])",
           (MTP, "-k", "independent_draft and heads"), "every draft head position runs head 0"),
    Mutant("verify-positions-off-by-one", "bitmtp/runtime/verify_prep.py",
           "torch.add(arange[:d], draft.positions[p - 1] + 1, out=verify.positions)",
           "torch.add(arange[:d], draft.positions[p - 1], out=verify.positions)",
           (*SPEC_SUBSET,), "the verify step runs at the last pending row's position"),
    Mutant("resolve-verify-position", "bitmtp/runtime/verify_prep.py",
           "torch.add(arange[:w], verify.positions[0] + a, out=next_draft.positions)",
           "torch.add(arange[:w], verify.positions[0] + a + 1, out=next_draft.positions)",
           (f"{MTP}::test_hybrid_verified_iterations_are_ar_exact",),
           "the draft after a device-resolved verify starts one position late"),
    Mutant("max-new-tokens-overshoot", "bitmtp/runtime/output.py",
           "elif len(self.tokens) >= self.max_new:", "elif len(self.tokens) > self.max_new:",
           (QUICK,), "one token more than max_new_tokens"),
    Mutant("capacity-overshoot", "bitmtp/runtime/decode.py",
           "engine.capacity + 1 - len(ids)", "engine.capacity + 2 - len(ids)",
           (f"{MTP}::test_capacity_and_eos_stops",), "generation runs one token past the KV store"),
    # -- model: the decoder's math and the fused native path -----------------------------------------
    Mutant("qk-norm-swap-per-op", "bitmtp/model/decoder.py",
           "q = rms_norm(q, layer.norm(Norm.Q), a.rms_norm_eps)",
           "q = rms_norm(q, layer.norm(Norm.K), a.rms_norm_eps)",
           ("tests/model/test_vs_transformers.py", "-k", "engine_greedy and qwen3"),
           "qwen3's q_norm applied to k and k_norm to q (per-op path)"),
    Mutant("qk-norm-swap-fused", "bitmtp/model/decoder.py",
           "ly.norm(Norm.Q), ly.norm(Norm.K),", "ly.norm(Norm.K), ly.norm(Norm.Q),",
           ("tests/model/test_vs_transformers.py", "-k", "engine_greedy and qwen3"),
           "qwen3's q/k norms swapped in the fused layers' table"),
    Mutant("fused-lora-always-unsupported", "bitmtp/model/decoder.py",
           "lora, scaling = self._fused_lora(plan, step.mask_block)",
           "raise FusedUnsupported('mutant: LoRA branch')",
           ("tests/ops/test_fused_layers.py", "-k", "gated_lora"),
           "draft steps silently fall back to the per-op path (issue 21)"),
    # -- the family registry and the layer spec (issue 22) ---------------------------------------------
    Mutant("activation-table-ignored", "bitmtp/model/decoder.py",
           "self._act = TORCH_ACTIVATIONS[self.spec.activation]", "self._act = silu",
           ("tests/model/test_families.py", "-k", "torch_path"),
           "the torch executor runs every activation as SiLU (a new family's GELU silently wrong)"),
    Mutant("mlp-out-norm-skipped", "bitmtp/model/decoder.py",
           "if layer.norm(Norm.MLP_OUT) is not None:", "if False:",
           ("tests/model/test_families.py", "-k", "torch_path"),
           "a family's extra norm after the MLP is loaded but never applied"),
    Mutant("fused-accepts-any-activation", "bitmtp/model/decoder.py",
           'self.spec.check("the fused CPU layers (csrc/cpu/layers.cpp)", FUSED_ACTIVATIONS, FUSED_NORMS)',
           'self.spec.check("the fused CPU layers (csrc/cpu/layers.cpp)", list(Activation), list(Norm))',
           ("tests/model/test_families.py", "-k", "torch_path"),
           "the fused CPU layers take a layer spec they do not implement"),
    # -- shipped adapters ----------------------------------------------------------------------------
    Mutant("shipped-preference-inverted", "bitmtp/shipped.py",
           'pref = float((cfg.training or {}).get("preference", 0))',
           'pref = -float((cfg.training or {}).get("preference", 0))',
           ("tests/test_shipped.py",), "the lowest preference wins"),
    # -- formats ---------------------------------------------------------------------------------------
    Mutant("act-quant-truncates", "bitmtp/formats/quantize.py",
           "x_q = (xf * s.unsqueeze(-1)).round().clamp(-128, 127)",
           "x_q = (xf * s.unsqueeze(-1)).trunc().clamp(-128, 127)",
           ("tests/formats/test_quantize.py",), "activations truncated instead of rounded half to even"),
    Mutant("t2-codes-negated", "bitmtp/formats/ternary.py",
           "codes[:, :k] = weight.to(torch.int64) + 1", "codes[:, :k] = 1 - weight.to(torch.int64)",
           ("tests/formats/test_t2.py",), "T2 packs -w"),
    Mutant("q4_0-offset", "bitmtp/formats/ggml_blocks.py",
           "w.sub_(8)\n            w.mul_(d)",
           "w.sub_(7)\n            w.mul_(d)",
           ("tests/formats/test_ggml_blocks.py", "-k", "dequantize_matches_gguf_py"), "Q4_0 codes offset by 7"),
    Mutant("q4_1-nibble-order", "bitmtp/formats/ggml_blocks.py",
           "w[..., :16].copy_(qs & 15)\n        w[..., 16:].copy_(qs >> 4)",
           "w[..., :16].copy_(qs >> 4)\n        w[..., 16:].copy_(qs & 15)",
           ("tests/formats/test_ggml_blocks.py", "-k", "dequantize_matches_gguf_py"), "Q4_1 high nibbles first"),
    Mutant("gguf-data-unaligned", "bitmtp/formats/gguf.py",
           "data_start = -(-c.pos // alignment) * alignment", "data_start = c.pos",
           ("tests/model/test_gguf_io.py", "-k", "export_load_is_exact or reader_lists"),
           "tensor data read from the end of the header, not the aligned start"),
    # --- issue 21's hardening: each fix has a test that fails without it
    Mutant("masked-nan-reaches-probs@V", "bitmtp/ops/reference.py",
           "out = torch.matmul(probs, torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0))",
           "out = torch.matmul(probs, values)",
           ("tests/runtime/test_masked_rows.py", "-k", "torch"),
           "0 * NaN of a masked KV row poisons the torch backend's attention again"),
    Mutant("engine-lock-removed", "bitmtp/runtime/engine.py",
           "self._lock = threading.Lock()", "self._lock = threading.Semaphore(2)",
           ("tests/runtime/test_concurrency.py", "-k", "two_threads_on_one_model or interleaved"),
           "two generations on one model share the KV store again"),
    Mutant("checkpoint-unpickled", "bitmtp/train/trainer.py",
           'state = torch.load(path, map_location="cpu", weights_only=True)',
           'state = torch.load(path, map_location="cpu", weights_only=False)',
           ("tests/train/test_resume.py", "-k", "crafted"),
           "train --resume runs the code a crafted state.pt carries"),
    Mutant("gguf-tokenizer-code-allowed", "bitmtp/formats/gguf_vocab.py",
           "if not isinstance(name, str) or name not in TOKENIZER_DATA_FILES:",
           "if not isinstance(name, str):",
           ("tests/test_api_inputs.py", "-k", "gguf_tokenizer_cannot_run_code"),
           "a GGUF's embedded tokenizer may carry a .py file again"),
    Mutant("gguf-finite-check-skipped", "bitmtp/model/gguf_io.py",
           "G.check_finite(t, src)", "pass",
           ("tests/model/test_load_validation.py", "-k", "gguf_non_finite"),
           "Inf/NaN GGUF weights load silently"),
    Mutant("patch-accepts-oov-ids", "bitmtp/hf.py",
           "bad = [t for t in prompt if not 0 <= t < vocab]", "bad = []",
           ("tests/test_hf.py", "-k", "out_of_vocabulary"),
           "a negative token id generates under bitmtp.patch instead of raising IndexError"),
    # --- issue 25's sampling: lossless and reproducible under every policy
    Mutant("sampling-two-pass-verify-counts-d1-as-committed", "bitmtp/runtime/two_pass.py",
           "verify.fresh_from.fill_(0)", "verify.fresh_from.fill_(1)",
           ("tests/runtime/test_sampling_decode.py", "-k", "every_verifying and penalties and two-pass-mask-block-2"),
           "a two-pass verify row's penalties miss d_1 (not committed yet): MTP sampling differs from AR"),
    Mutant("sampling-uniform-of-the-row-not-the-token", "bitmtp/decoding/sampling.py",
           "return inverse_cdf(probs, position_uniforms(self.seed, positions + 1))",
           "return inverse_cdf(probs, position_uniforms(self.seed, positions))",
           ("tests/runtime/test_sampling_decode.py", "-k", "reference_rule"),
           "a row samples with the uniform of its own position instead of the token's"),
    Mutant("sampling-top-p-drops-the-crossing-token", "bitmtp/decoding/sampling.py",
           "at = (cum < top_p).sum(-1, keepdim=True).clamp_(max=k - 1)",
           "at = (cum < top_p).sum(-1, keepdim=True).sub_(1).clamp_(min=0, max=k - 1)",
           ("tests/decoding/test_sampling.py", "-k", "large_vocabulary"),
           "the nucleus stops before the token whose probability reaches top_p"),
    Mutant("sampling-draft-rows-count-mask-tokens", "bitmtp/decoding/drafters.py",
           "tok, prob = _choose(runner, self.decoder.logits(hidden), runner.positions[:p], p)",
           "tok, prob = _choose(runner, self.decoder.logits(hidden), runner.positions[:p], 0)",
           ("tests/runtime/test_sampling_decode.py", "-k", "every_verifying and penalties and one-pass-heads-4"),
           "a heads one-pass step's AR rows ignore the guesses before them in their penalties"),
    Mutant("patch-sampling-ignores-temperature", "bitmtp/hf.py",
           'kw["temperature"] = float(p.temperature)', "pass",
           ("tests/test_hf.py", "-k", "distribution"),
           "patched sampling runs at temperature 1 whatever the call says"),
    # --- session 13's half rows: exact, and never aliasing a live model's weights
    Mutant("half-rows-alias-the-callers-tensor", "bitmtp/model/loaders.py",
           "return from_half(x.detach().clone())", "return from_half(x.detach())",
           ("tests/model/test_half_rows.py", "-k", "copy_of_a_live_model"),
           "a live bf16 model changed after bitmtp.load changes the loaded decoder's weights"),
    Mutant("half-rows-f16-read-as-bf16", "bitmtp/formats/ggml_blocks.py",
           'HALF_FORMATS = {"bf16": torch.bfloat16, "f16": torch.float16}',
           'HALF_FORMATS = {"bf16": torch.bfloat16, "f16": torch.bfloat16}',
           ("tests/formats/test_ggml_blocks.py", "-k", "half_rows_share_memory"),
           "f16 rows decoded as bfloat16 on the float path"),
    Mutant("act-quant-reciprocal-rounds-down", "wgsl_fallback/act_quant.wgsl",
           "if ((quo & 1u) == 1u) { mant += 1u; }", "",
           ("tests/wgsl_fallback/test_act_quant.py", "-k", "correctly_rounded_reciprocal"),
           "the Vulkan activation scale truncated instead of rounded (an ulp off, as NVIDIA's division was)"),
    Mutant("answer-only-anchors-in-prompts", "bitmtp/train/data.py",
           "rec_mask = [False] * pt + [True] * (len(ids) - pt)",
           "rec_mask = [True] * len(ids)",
           ("tests/train/test_answer_only.py", "-k", "whole_records"),
           "train --answer-only still anchors draft blocks in the prompts"),
    Mutant("answer-only-masks-ignored", "bitmtp/train/trainer.py",
           'extra["block_weight"] = anchor_weights(anchor_masks, idx, anchors, device)',
           "pass",
           ("tests/train/test_answer_only.py", "-k", "run_trains"),
           "train --answer-only computes the masks but every block counts"),
    # -- the prompt-prefix cache ------------------------------------------------------------------------
    Mutant("prefix-cache-reuses-partial-chunks", "bitmtp/runtime/engine.py",
           "            common = min(common, self._kept_chunks) // self.prefill_chunk * self.prefill_chunk",
           "            common = common",
           ("tests/runtime/test_prefix_cache.py", "-k", "whole_prefill_chunks"),
           "without width-invariant rows, rows of a partial prefill chunk or of generated tokens are reused"),
    Mutant("prefix-cache-keeps-unverified-rows", "bitmtp/runtime/decode.py",
           "    if not pol.drafts or pol.lossless:  # rows [0, n) hold the prompt and the tokens committed after it",
           "    if True:  # rows [0, n) hold the prompt and the tokens committed after it",
           ("tests/runtime/test_prefix_cache.py", "-k", "hybrid"),
           "a lossy policy's unverified tokens' KV rows are reused as if a prefill had written them"),
    Mutant("batch-prefix-cache-keeps-overwritten-ranges", "bitmtp/runtime/batch_schedule.py",
           "            del self.kept[b]", "            pass",
           ("tests/runtime/test_batch.py", "-k", "starts_like_a_finished"),
           "a kept range another sequence's rows overwrote is reused as if it still held its tokens"),
    Mutant("batch-shared-prefix-misses-a-row", "bitmtp/runtime/batch_schedule.py",
           "self.copy_rows(src + seq.n, seq.base + seq.n, best - seq.n)",
           "self.copy_rows(src + seq.n, seq.base + seq.n, best - seq.n - 1)",
           ("tests/runtime/test_batch.py", "-k", "share_a_prefix"),
           "a prompt that shares another range's prefix skips a row it never copied"),
    Mutant("batch-shared-prefix-where-rows-depend-on-the-pass", "bitmtp/runtime/batch_schedule.py",
           "if self.reuse and self.share(seq, plan):", "if self.share(seq, plan):",
           ("tests/runtime/test_batch.py", "-k", "bits_depend"),
           "prompts copy rows whose bits depend on the pass that wrote them (the fused GPU step)"),
    Mutant("batch-prompt-rows-priced-alike-at-every-depth", "bitmtp/runtime/batch_schedule.py",
           "    each = 1 + depth / scale", "    each = 1.0",
           ("tests/runtime/test_batch.py", "-k", "shrink_with_depth"),
           "a long prompt's deep rows cost a step as much as its first ones: running streams stall as it goes"),
    Mutant("live-costs-never-forget", "bitmtp/runtime/calibration.py",
           "        while times and now - times[0][0] > STEP_TIMES_KEPT_S:", "        while False:",
           ("tests/runtime/test_calibration.py", "-k", "forget or expire"),
           "a width priced high by a few disturbed steps stays priced so: auto decodes repeats token by token"),
    Mutant("batch-step-cost-never-forgets", "bitmtp/decoding/batch_plan.py",
           "        if count >= self.MIN_SEEN and self.clock() - last <= STEP_TIMES_KEPT_S:",
           "        if count >= self.MIN_SEEN:",
           ("tests/runtime/test_batch.py", "-k", "forgets"),
           "a batch keeps pricing a width by steps timed under another moment's load"),
    Mutant("step-tail-ignores-an-overridden-head", "bitmtp/ops/head.py",
           '                       "__self__", None) is not owner \\',
           '                       "__self__", None) is None and False \\',
           ("tests/ops/test_head.py", "-k", "native_call"),
           "the one-call tail runs the native head where another LM head op was chosen (an override, a backend)"),
    Mutant("fused-plan-keeps-checks-of-other-tensors", "bitmtp/ops/fused_layers.py",
           "memo[0] != scalars or not all(map(is_, memo[1], tensors))", "memo[0] != scalars",
           ("tests/ops/test_fused_layers.py", "-k", "kept_only"),
           "the fused layers reuse the previous step's checks and pointers for new input tensors"),
    Mutant("step-inputs-ignore-the-lower-bound", "bitmtp/ops/step_inputs.py",
           "0 if lo is None else lo.ctypes.data", "0",
           ("tests/ops/test_step_inputs.py",),
           "a batched step's rows see the KV rows of the sequences below their own (the native mask's lower bound)"),
    Mutant("fused-tail-reads-the-first-rows", "bitmtp/ops/fused_layers.py",
           "0 if rows is None else rows.data_ptr(), m,", "0, m,",
           ("tests/model/test_choose_step.py",),
           "the tail inside the fused layers' call chooses for the step's first rows, not the rows read"),
    # -- batching: many sequences in one step ---------------------------------------------------------
    Mutant("batch-kv-off-the-attention-chunks", "bitmtp/runtime/batch_schedule.py", "ALIGN = 256", "ALIGN = 48",
           ("tests/runtime/test_batch.py", "-k", "greedy and bitnet"),
           "sequences' KV ranges start off the attention's chunk grid: rows lose their solo bits"),
    Mutant("batch-rows-see-other-sequences", "bitmtp/runtime/batch_pass.py",
           "StepInputsFill(ints[1], ints[3], ints[4],", "StepInputsFill(ints[1], None, ints[4],",
           ("tests/runtime/test_batch.py", "-k", "greedy and bitnet"),
           "a batch row attends to the KV rows of the sequences stored before its own"),
    Mutant("batch-rows-see-other-sequences-off-the-cpu", "bitmtp/runtime/batch_pass.py",
           "mask = (kv >= base[:, None]) & (kv <= end[:, None])", "mask = kv <= end[:, None]",
           ("tests/runtime/test_host_inputs.py", "-k", "numpy_and_by_torch"),
           "on a GPU (the torch path of a step's inputs) a batch row attends to other sequences' KV rows"),
    Mutant("batch-cancel-keeps-rows", "bitmtp/runtime/batch_schedule.py",
           "            self.alloc.free(seq.base, seq.rows)", "            pass",
           ("tests/runtime/test_batch.py", "-k", "join_and_leave"),
           "a finished or cancelled sequence never gives its KV rows back"),
    Mutant("batch-close-during-a-step-keeps-rows", "bitmtp/runtime/batch.py",
           "        if self._lock.acquire(timeout=CANCEL_WAIT_S):", "        if self._lock.acquire(blocking=False):",
           ("tests/runtime/test_batch.py", "-k", "closing_while"),
           "a sequence closed while another thread steps keeps its rows until a later step that may never come"),
    Mutant("batch-mask-rows-see-only-themselves", "bitmtp/runtime/batch_rows.py",
           "            reach += [last + m] * m",
           "            reach += list(range(last + 1, last + 1 + m))",
           ("tests/runtime/test_batch.py", "-k", "mask_rows"),
           "a batched step's mask rows attend causally instead of to their whole block"),
    Mutant("batch-keeps-drafts-after-a-rejection", "bitmtp/decoding/batch_plan.py",
           "        full = bool(draft.mask_rows) and a == 1 + len(guesses)", "        full = bool(draft.mask_rows)",
           ("tests/runtime/test_batch.py", "-k", "mask_rows"),
           "a batched sequence keeps its mask drafts after a rejected guess (they assumed every guess)"),
    Mutant("batch-accepts-every-guess", "bitmtp/runtime/batch.py",
           "a = speculative_accept([outs[0], *g.tokens[1:]], outs)",
           "a = len(outs)",
           ("tests/runtime/test_batch.py", "-k", "auto_adds and greedy"),
           "a batched sequence commits all its lookup guesses, verified or not"),
    Mutant("batch-of-one-ignores-the-block-size", "bitmtp/decoding/batch_plan.py",
           "            left = min(room.rows, room.tokens, self.max_rows - 1, sd.max_guesses)",
           "            left = min(room.rows, room.tokens, self.max_rows - 1)",
           ("tests/runtime/test_batch.py", "-k", "d_minus_one"),
           "generate's batch of one drafts past block_size D (a solo step gives at most D - 1 guesses)"),
    Mutant("batch-lookup-never-retried", "bitmtp/decoding/batch_plan.py",
           '                probe = source == "lookup" and sd.since_lookup >= EXPLORE_EVERY * len(seqs)',
           '                probe = False',
           ("tests/runtime/test_batch.py", "-k", "retried"),
           "a batch's lookup estimates held low by other prompts are never tried again (a long-lived process stops "
           "drafting by lookup)"),
    Mutant("batch-of-one-runs-any-drafter", "bitmtp/decoding/config.py",
           '        return self.policy.name == "auto" and (isinstance(d, LookupDrafter) or self.mask_block is not None)',  # noqa: E501
           '        return self.policy.name == "auto"',
           ("tests/runtime/test_batch.py", "-k", "solo_engine"),
           "auto with an oracle drafter decodes on the batch engine, which drops the drafter"),
    Mutant("generate-ignores-batcher-false", "bitmtp/api.py",
           "    if batcher is False:\n        return None",
           "    if batcher is False and not batches_alone(model, cfg):\n        return None",
           ("tests/runtime/test_batch.py", "-k", "solo_engine"),
           "batcher=False still decodes ar / auto as a batch of one"),
)


def _files_to_copy(root: Path) -> list[Path]:
    """Tracked and untracked-but-not-ignored files (the working tree as it is), plus the built native
    extensions, which are ignored by git but needed to run the CPU kernels."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    files = [Path(p) for p in out.split("\0") if p]
    files += [p.relative_to(root) for p in (root / "bitmtp").rglob("*.so")]
    return sorted({f for f in files if (root / f).is_file()})


def make_copy(root: Path, dest: Path) -> None:
    for rel in _files_to_copy(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


# Run pytest in the copy. An editable install of bitmtp maps bitmtp.triton_kernels and friends to the
# ORIGINAL checkout through a meta-path finder; point that mapping at the copy as well, and put the copy
# first on sys.path, so every bitmtp module the tests import comes from the mutated copy.
_BOOT = r"""
import sys
root, copy = sys.argv[1], sys.argv[2]
sys.path.insert(0, copy)
for name, mod in list(sys.modules.items()):
    if name.startswith("__editable__") and "bitmtp" in name:
        for attr in ("MAPPING", "NAMESPACES"):
            table = getattr(mod, attr, None)
            if isinstance(table, dict):
                for key, val in table.items():
                    if isinstance(val, str):
                        table[key] = val.replace(root, copy)
                    elif isinstance(val, list):
                        table[key] = [v.replace(root, copy) for v in val]
import bitmtp
assert bitmtp.__file__.startswith(copy), f"bitmtp imported from {bitmtp.__file__}, not the copy {copy}"
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """pytest ``-x`` on ``tests`` inside ``copy``: (return code or None on timeout, output tail)."""
    cmd = [sys.executable, "-c", _BOOT, str(ROOT), str(copy), "-q", "-x", "-p", "no:cacheprovider",
           "--no-header", "-m", "not slow", *tests]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(copy))
    # one thread per test run: on a shared 2-core machine, OpenMP threads spinning against each other
    # made a 2 s test take minutes
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "timeout"
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def apply(copy: Path, m: Mutant) -> str | None:
    """Apply ``m`` in ``copy``; None when no alternative occurs exactly once (stale), else the edit used."""
    path = copy / m.file
    if not path.is_file():
        return None
    text = path.read_text()
    for old, new in m.edits():
        if text.count(old) == 1:
            path.write_text(text.replace(old, new))
            return old
    return None


def check_one(m: Mutant, timeout: float) -> tuple[Mutant, str, float, str]:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bitmtp-mutant-") as tmp:
        copy = Path(tmp)
        make_copy(ROOT, copy)
        if apply(copy, m) is None:
            return m, "stale", time.monotonic() - t0, f"snippet not found exactly once in {m.file}"
        rc, tail = run_tests(copy, m.tests, timeout)
    dt = time.monotonic() - t0
    if rc is None:
        return m, "caught", dt, "timeout"
    if rc in (1, 2):  # failures, or an error while collecting/running (the mutant broke an import)
        return m, "caught", dt, _first_failure(tail)
    if rc == 0:
        return m, "SURVIVED", dt, ""
    return m, "error", dt, f"pytest exit {rc} (no tests selected?): {tail[-400:]}"


def _first_failure(tail: str) -> str:
    for line in tail.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            return line[:160]
    return tail.strip().splitlines()[-1][:160] if tail.strip() else ""


def baseline(mutants: list[Mutant], timeout: float) -> tuple[bool, str]:
    """The union of the mutants' tests on the unmutated copy: they must pass."""
    with tempfile.TemporaryDirectory(prefix="bitmtp-baseline-") as tmp:
        copy = Path(tmp)
        make_copy(ROOT, copy)
        failed = []
        # -k expressions cannot be merged into one run: group by test arguments
        for tests in dict.fromkeys(m.tests for m in mutants):
            rc, tail = run_tests(copy, tests, timeout)
            if rc != 0:
                failed.append(f"{' '.join(tests)}: exit {rc}\n{tail[-1500:]}")
        return not failed, "\n".join(failed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", dest="select", default="", help="only mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--jobs", type=int, default=1, help="mutants checked at a time (default 1)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per test run (a timeout counts as caught)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    args = ap.parse_args(argv)
    # a SIGTERM (CI cancelling the job) unwinds like Ctrl-C, so the temporary copies are removed
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    mutants = [m for m in MUTANTS if args.select in m.name]
    if not mutants:
        print(f"-k {args.select!r}: no mutant matches; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.name:42s} {m.file}\n    {m.why}\n    tests: {' '.join(m.tests)}")
        return 0
    t0 = time.monotonic()
    if not args.no_baseline:
        ok, why = baseline(mutants, args.timeout)
        print(f"baseline (named tests, unmutated): {'pass' if ok else 'FAIL'} ({time.monotonic() - t0:.0f} s)",
              flush=True)
        if not ok:
            print(why)
            return 1
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(check_one, m, args.timeout) for m in mutants]
        for fut in concurrent.futures.as_completed(futures):
            m, verdict, dt, note = fut.result()
            rows.append((m, verdict, dt, note))
            print(f"{verdict:8s} {dt:6.0f} s  {m.name:42s} {note}", flush=True)
    bad = [r for r in rows if r[1] != "caught"]
    total = time.monotonic() - t0
    print(f"\n{len(rows) - len(bad)}/{len(rows)} caught in {total:.0f} s")
    for m, verdict, _, note in bad:
        print(f"  {verdict}: {m.name} ({m.file}: {m.why}) {note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
