"""``python -m bitmtp convert``: write a model (base + MTP adapter + tokenizer) as one GGUF file."""

from __future__ import annotations

import argparse
import sys
from collections import Counter


def _cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    import bitmtp
    from bitmtp.cli_common import default_model_path
    from bitmtp.errors import BitMTPError
    from bitmtp.formats.gguf import SPEC, read_gguf

    out = Path(args.output)
    if out.suffix != ".gguf":
        raise BitMTPError(f"--output: {out} should end in .gguf")
    if out.exists() and not args.overwrite:
        raise BitMTPError(f"--output: {out} already exists; pass --overwrite to replace it")
    if args.adapter and args.no_adapter:
        raise BitMTPError("--adapter and --no-adapter contradict each other")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    source = args.source or default_model_path()
    if args.plain and args.adapter:
        raise BitMTPError("--plain writes no MTP adapter (stock llama.cpp refuses extra tensors); drop --adapter")
    adapter = None if args.no_adapter or args.plain else (args.adapter or "auto")
    print(f"loading {source} ...", file=sys.stderr)
    model = bitmtp.load(source, quantize=args.quantize, dtype=dtype, adapter=adapter)
    try:
        # atomic: a temporary file beside --output, removed on an error, Ctrl-C, SIGTERM or SIGHUP
        path = model.save_gguf(out, adapter=not args.no_adapter, overwrite=args.overwrite, name=args.name,
                               plain=args.plain)
    except OSError as exc:  # disk full, permissions, a read-only folder: the user's to fix, not a bug
        raise BitMTPError(f"--output: cannot write {out}: {exc.strerror or exc}; free space on that disk or choose "
                          "another --output (nothing was left behind)") from exc
    contents = read_gguf(path)
    types = Counter(t.type_name for n, t in contents.tensors.items() if not n.startswith("bitmtp."))
    size = path.stat().st_size
    src_path = Path(source) if isinstance(source, (str, Path)) else None
    of_source = (f", source {src_path.stat().st_size / 2**20:.1f} MiB"
                 if src_path is not None and src_path.is_file() else "")
    print(f"wrote {path} ({size / 2**20:.1f} MiB{of_source}): {len(contents.tensors)} tensors; base tensor types "
          + ", ".join(f"{k} x{v}" for k, v in sorted(types.items())))
    spec = {k[len(SPEC):]: (round(v, 6) if isinstance(v, float) else v)
            for k, v in contents.meta.items() if k.startswith(SPEC) and not k.endswith(".config")}
    if spec:
        print("speculative: " + ", ".join(f"{k}={v}" for k, v in spec.items()))
    else:
        print("speculative: none (plain model; bitmtp.load decodes it AR)")
    if args.plain:
        print("plain: only tensors llama.cpp creates; ternary scales rounded to fp16 (not bit-exact in bitmtp)")
    has_vocab = "tokenizer.ggml.tokens" in contents.meta
    print(f"tokenizer: {'GGML vocabulary + ' if has_vocab else ''}"
          f"{'bitmtp tokenizer files' if 'bitmtp.tokenizer.files' in contents.meta else 'none'}")
    return 0


def add_commands(sub) -> None:
    cv = sub.add_parser(
        "convert", help="write a model and its MTP adapter as one GGUF file",
        description="Convert a model (HF folder, .gguf, or the embedded default) and its MTP adapter into one GGUF "
                    "file: ternary weights as TQ2_0 where the layout allows (Q4_0 or F32 otherwise; exact float32 "
                    "scales kept under bitmtp.scale.*), dense weights that came from Q4_0 / Q4_1 / Q8_0 blocks as "
                    "those same blocks (a quantized GGUF stays its size), other dense weights in --dtype, the "
                    "tokenizer and chat template, "
                    "and the adapter under bitmtp.mtp.* with bitmtp.speculative.* metadata. bitmtp.load(FILE) arms "
                    "the adapter; readers that ignore unknown keys and tensors (transformers' GGUF loader) load the "
                    "plain base model. The file is written atomically: an error, Ctrl-C, SIGTERM or SIGHUP leaves no "
                    "temporary or partial file.",
    )
    cv.add_argument("source", nargs="?", help="HF checkpoint folder or .gguf file (default: the embedded "
                                              "SmolLM2-135M-Instruct)")
    cv.add_argument("--to", choices=["gguf"], default="gguf", help="output format (default gguf)")
    cv.add_argument("-o", "--output", required=True, metavar="FILE", help="the .gguf file to write")
    cv.add_argument("--adapter", metavar="DIR", help="MTP adapter folder to pack (default: the source's own or the "
                                                     "shipped adapter for this exact model, if any)")
    cv.add_argument("--no-adapter", action="store_true", help="write the base model only")
    cv.add_argument("--quantize", choices=["ternary"], help="ternarize float linear weights by absmean first")
    cv.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="dtype of dense weights (embeddings, LM head, non-ternary projections); float32 (the "
                         "default) keeps a float32 model exact and a GGUF source's Q4_0 / Q4_1 / Q8_0 blocks as "
                         "they are; float16 / bfloat16 write every dense weight in that dtype")
    cv.add_argument("--plain", action="store_true",
                    help="write a file stock llama.cpp loads: it refuses files with tensors its architecture does "
                         "not create, so no MTP adapter and no exact-scale tensors (ternary scales rounded to fp16)")
    cv.add_argument("--name", help="general.name of the file (default: the source's name)")
    cv.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    cv.set_defaults(func=_cmd_convert)
