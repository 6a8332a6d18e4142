"""Command line: ``python -m bitmtp <command>`` (also the ``bitmtp`` console script).

Commands present in this build:

  info    version, torch, and every backend with whether it can run here and why not
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bitmtp",
        description="bitmtp: multi-token decoding for ternary (W2A8) language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="show versions and which backends can run here (and why not)",
                          description="Show bitmtp/torch versions and every backend's availability with the reason.")
    info.set_defaults(func=_cmd_info)
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
