"""Ahead-of-time compilation of every Triton kernel for real GPU targets, without a GPU.

The interpreter accepts code that the real compiler rejects (shapes, dtypes, layouts), so CI
compiles each kernel — every decode width M = 1..16 and the tiled kernel, each output dtype —
down to a cubin for sm_80 and sm_90 with ``triton.compile(ASTSource(...), target=GPUTarget(...))``.

    python -m bitmtp.triton_kernels.aot --cc 80 90

Reference: bitmtp.ops.reference.w2a8_linear_q_reference
Reference: bitmtp.ops.reference.attention_reference (the kernels it compiles)
Reference: bitmtp.ops.reference.rms_norm_reference (the fused GPU step's kernels, triton_kernels/layers.py)
Test: .ci/run (CI compiles every kernel for sm_80 and sm_90)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bitmtp.triton_kernels import w2a8
from bitmtp.triton_kernels.layers import NO_FMA

_COMMON_PTRS = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*fp32", "bias_ptr": "*fp32"}


def kernel_specs():
    """Yield ``(label, fn, signature, constexprs, num_warps)`` for every kernel variant to compile."""
    for out_ty in ("fp32", "bf16", "fp16"):
        for lo, hi, cfg in (*w2a8.WIDTH_BUCKETS, (2, 16, w2a8.SMALL_TILED)):
            flag_sets = [dict(HAS_BIAS=True, WRITE_ACC=False, WRITE_OUT=True)]
            if out_ty == "fp32":
                flag_sets.append(dict(HAS_BIAS=False, WRITE_ACC=True, WRITE_OUT=False))
            for flags in flag_sets:
                ptrs = dict(_COMMON_PTRS, out_ptr=f"*{out_ty}", acc_ptr="*i32")
                if cfg.kind == "decode":
                    for m in range(lo, hi + 1):
                        sig = dict(ptrs, N="i32", K="i32", KW="i32", G="i32", NG="i32", stride_sn="i32")
                        const = dict(M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
                                     BLOCK_KW=cfg.block_kw, **flags)
                        for name in const:
                            sig[name] = "constexpr"
                        yield f"decode M={m} out={out_ty} {flags}", w2a8._w2a8_decode_kernel, sig, const, cfg.num_warps
                else:
                    sig = dict(ptrs, M="i32", N="i32", K="i32", KW="i32", G="i32", NG="i32", stride_sn="i32")
                    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_kw, **flags)
                    for name in const:
                        sig[name] = "constexpr"
                    yield (f"tiled BLOCK_M={cfg.block_m} out={out_ty} {flags}", w2a8._w2a8_tiled_kernel, sig, const,
                           cfg.num_warps)


def attention_specs():
    """The attention kernel for the head sizes of the supported families, fp32/bf16 activations."""
    from bitmtp.triton_kernels import attention

    for ty in ("fp32", "bf16"):
        for d in (64, 128):
            sig = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "mask_ptr": "*u8", "out_ptr": f"*{ty}",
                   "H": "i32", "S": "i32", "L": "i32", "scale": "fp32", "GROUP": "i32",
                   "D": "constexpr", "D_PAD": "constexpr", "BLOCK_L": "constexpr"}
            const = {"D": d, "D_PAD": d, "BLOCK_L": attention.BLOCK_L}
            yield f"attention D={d} {ty}", attention._attention_row_kernel, sig, const, 4


def _spec(fn, types: dict[str, str], const: dict[str, object]) -> tuple[dict[str, str], dict[str, object]]:
    """A kernel's signature in its argument order: ``types`` for the runtime arguments, ``constexpr`` for ``const``."""
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in const else types[name]
    return sig, const


def layer_specs():
    """The fused GPU step's kernels (triton_kernels/layers.py) at the shapes of the models the step covers:
    BitNet-2B (hidden 2560, 20/5 heads of 128, ffn 6912, vocab 128256) and SmolLM2 (hidden 576, 9/3 heads of 64,
    ffn 1536), every epilogue, with and without the mask rows' LoRA, bf16 and fp32 weights / caches."""
    from bitmtp.triton_kernels import layers as ly

    i32, f32 = "i32", "fp32"
    # the row length only sets BLOCK: the smallest and the largest block
    for k in (576, 6912):
        for norm, quant, store_f, lora in ((True, True, False, False), (True, False, True, False),
                                           (False, True, False, True), (True, True, False, True)):
            types = dict(x_ptr="*fp32", w_ptr="*fp32", q_ptr="*i8", s_ptr="*fp32", f_ptr="*fp32", a_ptr="*fp32",
                         t_ptr="*fp32", M=i32, K=i32, stride_x=i32, stride_f=i32, eps=f32, FIRST=i32, RT=i32)
            const = dict(BLOCK=triton.next_power_of_2(k), NORM=norm, QUANT=quant, STORE_F=store_f, LORA=lora,
                         RT_PAD=16)
            yield (f"norm_quant K={k} norm={norm} quant={quant} lora={lora}", ly._norm_quant_kernel,
                   *_spec(ly._norm_quant_kernel, types, const), 4)
    ptrs = dict(pos_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", lb_ptr="*fp32", lt_ptr="*fp32",
                cnt_ptr="*i32", out_ptr="*fp32", qn_ptr="*fp32", kn_ptr="*fp32", eps="fp32")
    ints = {n: i32 for n in ("M", "N", "K", "KW", "NG", "GROUP_K", "stride_sn", "stride_o", "SPLIT_K", "HALF_OR_I",
                             "HQ", "HKV", "S_ROWS", "HD", "FIRST", "RT", "stride_x")}
    # every epilogue with and without LoRA; the KV cache's dtype only matters to the qkv epilogue
    for kv in ("bf16", "fp32"):
        for epi, act, block_n in ((0, 0, 64), (1, 0, 64), (2, 0, 64), (2, 1, 64), (3, 0, 64), (3, 0, 32)):
            if kv == "fp32" and epi != 3:
                continue
            # the q / k norms (Qwen3) only in the qkv epilogue, without LoRA (as with it: the same code)
            for lora, qk in ((False, False), (True, False)) + (((False, True),) if epi == 3 and kv == "bf16" else ()):
                types = dict(ptrs, **ints, xq_ptr="*i8", xs_ptr="*fp32", w_ptr="*i32", s_ptr="*fp32", acc_ptr="*i32",
                             kc_ptr=f"*{kv}", vc_ptr=f"*{kv}", scaling=f32)
                const = dict(BLOCK_N=block_n, EPI=epi, ACT=act, TWO=epi >= 2, LORA=lora, RT_PAD=16, QK_NORM=qk)
                yield (f"w2a8_fused EPI={epi} ACT={act} BLOCK_N={block_n} kv={kv} lora={lora} qk_norm={qk}",
                       ly._w2a8_fused_kernel, *_spec(ly._w2a8_fused_kernel, types, const), 4)
                for wt in ("bf16", "fp32") if epi == 0 else ("bf16",):
                    types = dict(ptrs, **ints, x_ptr="*fp32", w_ptr=f"*{wt}", bias_ptr="*fp32", part_ptr="*fp32",
                                 kc_ptr=f"*{kv}", vc_ptr=f"*{kv}", scaling=f32)
                    const = dict(BLOCK_N=block_n, EPI=epi, ACT=act, TWO=epi >= 2, HAS_BIAS=epi != 3, IEEE=wt == "fp32",
                                 LORA=lora, RT_PAD=16, QK_NORM=qk)
                    yield (f"dense_fused EPI={epi} w={wt} BLOCK_N={block_n} kv={kv} lora={lora} qk_norm={qk}",
                           ly._dense_fused_kernel, *_spec(ly._dense_fused_kernel, types, const), 4)
        for heads, kvh, d in ((20, 5, 128), (9, 3, 64)) if kv == "bf16" else ((9, 3, 64),):
            group = heads // kvh
            r = triton.next_power_of_2(ly.ROWS * group)
            types = dict(q_ptr="*fp32", k_ptr=f"*{kv}", v_ptr=f"*{kv}", mask_ptr="*u8", pm_ptr="*fp32", pl_ptr="*fp32",
                         pacc_ptr="*fp32", M=i32, L=i32, S_ROWS=i32, H=i32, scale=f32, NSPLIT_MAX=i32)
            const = dict(GROUP=group, D=d, R=r, SPLIT=ly.ATTN_SPLIT, BLOCK_L=ly.ATTN_BLOCK)
            yield (f"attention_partial H={heads}/{kvh} D={d} kv={kv}", ly._attn_partial_kernel,
                   *_spec(ly._attn_partial_kernel, types, const), 4)
            for norm, quant, lora in ((True, True, False), (False, True, True), (False, False, True)) if kv == "bf16" \
                    else ():
                types = dict(pm_ptr="*fp32", pl_ptr="*fp32", pacc_ptr="*fp32", w_ptr="*fp32", q_ptr="*i8",
                             s_ptr="*fp32", f_ptr="*fp32", a_ptr="*fp32", t_ptr="*fp32", stride_f=i32, M=i32,
                             NSPLIT=i32, NSPLIT_MAX=i32, eps=f32, FIRST=i32, RT=i32)
                const = dict(H=heads, H_PAD=triton.next_power_of_2(heads), GROUP=group, D=d, R=r, NORM=norm,
                             STORE_F=not quant, QUANT=quant, LORA=lora, RT_PAD=16)
                yield (f"attention_combine H={heads} D={d} norm={norm} quant={quant} lora={lora}",
                       ly._attn_combine_kernel, *_spec(ly._attn_combine_kernel, types, const), 4)
    for wt, k, vocab in (("bf16", 2560, 128256), ("fp32", 576, 49152)):
        types = dict(tok_ptr="*i64", emb_ptr=f"*{wt}", me_ptr="*fp32", out_ptr="*fp32", M=i32, K=i32, FIRST=i32)
        const = dict(BLOCK=triton.next_power_of_2(k))
        yield f"embed K={k} {wt}", ly._embed_kernel, *_spec(ly._embed_kernel, types, const), 4
        types = dict(h_ptr="*fp32", w_ptr=f"*{wt}", pmax_ptr="*fp32", parg_ptr="*i32", p2v_ptr="*fp32", p2i_ptr="*i32",
                     psum_ptr="*fp32", M=i32, V=i32, K=i32, NVB=i32)
        const = dict(BLOCK_V=ly.HEAD_BLOCK, BK=64, IEEE=wt == "fp32")
        yield f"head_partial K={k} {wt}", ly._head_partial_kernel, *_spec(ly._head_partial_kernel, types, const), 4
        types = dict(h_ptr="*fp32", w_ptr=f"*{wt}", out_ptr="*fp32", M=i32, V=i32, K=i32, stride_o=i32)
        yield f"head_logits K={k} {wt}", ly._head_logits_kernel, *_spec(ly._head_logits_kernel, types, const), 4
        types = dict(pmax_ptr="*fp32", parg_ptr="*i32", p2v_ptr="*fp32", p2i_ptr="*i32", psum_ptr="*fp32",
                     tok_ptr="*i64", prob_ptr="*fp32", second_ptr="*i64", M=i32, NVB=i32)
        const = dict(NVB_PAD=triton.next_power_of_2(triton.cdiv(vocab, ly.HEAD_BLOCK)))
        yield f"head_combine V={vocab}", ly._head_combine_kernel, *_spec(ly._head_combine_kernel, types, const), 4


_SPECS: list = []


def _compile_one(job: tuple[int, int]) -> tuple[str, str | None, int]:
    """Compile spec ``job[1]`` for compute capability ``job[0]``: (label, error or None, shared bytes)."""
    cc, i = job
    label, fn, sig, const, num_warps = _SPECS[i]
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=const)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps, **NO_FMA})
        return label, None, compiled.metadata.shared
    except Exception as exc:  # report every failing variant, then fail
        return label, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", 0


def compile_all(ccs: list[int], verbose: bool = False, jobs: int = 0) -> int:
    """Compile every spec for every compute capability (``jobs`` processes; 0: one per CPU); return the number
    of failures. Two processes halve CI's step on two cores (each variant is an independent compile)."""
    _SPECS[:] = [*kernel_specs(), *attention_specs(), *layer_specs()]
    jobs = jobs or os.cpu_count() or 1
    failures = 0
    for cc in ccs:
        t0, count = time.time(), 0
        work = [(cc, i) for i in range(len(_SPECS))]
        if jobs > 1:  # fork: the children inherit the spec list (kernels are not picklable)
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
                results = list(pool.map(_compile_one, work))
        else:
            results = [_compile_one(job) for job in work]
        for label, err, shared in results:
            if err is None:
                count += 1
                if verbose:
                    print(f"  sm_{cc} ok   {label}: {shared} B smem")
            else:
                failures += 1
                print(f"  sm_{cc} FAIL {label}: {err}")
        print(f"sm_{cc}: compiled {count} Triton kernel variants in {time.time() - t0:.1f}s")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cc", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every variant")
    p.add_argument("-j", "--jobs", type=int, default=0, help="compile processes (default: one per CPU)")
    args = p.parse_args(argv)
    failures = compile_all(args.cc, args.verbose, args.jobs)
    if failures:
        print(f"{failures} Triton kernel variant(s) failed to compile", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
