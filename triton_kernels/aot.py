"""Ahead-of-time compilation of every Triton kernel for real GPU targets, without a GPU.

The interpreter accepts code that the real compiler rejects (shapes, dtypes, layouts), so CI
compiles each kernel — every decode width M = 1..16 and the tiled kernel, each output dtype —
down to a cubin for sm_80 and sm_90 with ``triton.compile(ASTSource(...), target=GPUTarget(...))``.

    python -m bitmtp.triton_kernels.aot --cc 80 90

Reference: bitmtp.ops.reference.w2a8_linear_q_reference
Reference: bitmtp.ops.reference.attention_reference (the kernels it compiles)
Test: .ci/run (CI compiles every kernel for sm_80 and sm_90)
"""

from __future__ import annotations

import argparse
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bitmtp.triton_kernels import w2a8

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


def compile_all(ccs: list[int], verbose: bool = False) -> int:
    """Compile every spec for every compute capability; return the number of failures."""
    failures = 0
    for cc in ccs:
        target = GPUTarget("cuda", cc, 32)
        t0, count = time.time(), 0
        for label, fn, sig, const, num_warps in [*kernel_specs(), *attention_specs()]:
            try:
                src = ASTSource(fn=fn, signature=sig, constexprs=const)
                compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
                count += 1
                if verbose:
                    print(f"  sm_{cc} ok   {label}: {compiled.metadata.shared} B smem")
            except Exception as exc:  # report every failing variant, then fail
                failures += 1
                print(f"  sm_{cc} FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        print(f"sm_{cc}: compiled {count} Triton kernel variants in {time.time() - t0:.1f}s")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cc", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every variant")
    args = p.parse_args(argv)
    failures = compile_all(args.cc, args.verbose)
    if failures:
        print(f"{failures} Triton kernel variant(s) failed to compile", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
