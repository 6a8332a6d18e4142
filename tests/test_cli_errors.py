"""The command line's error contract: every bad argument and every BitMTPError prints exactly one line
``bitmtp: error: ...`` (naming the flag and the fix) on stderr and exits 2; a bug exits 1 with one line;
``--debug`` (before or after the command) shows the traceback; Ctrl-C exits 130 and a closed stdout pipe
exits quietly. The checks run before any model loads, so these calls are fast."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bitmtp
from bitmtp import cli, cli_train
from bitmtp.errors import BitMTPError
from tests.support.paths import REPO_ROOT as ROOT


def _one_error_line(capsys, argv: list[str], status: int = 2) -> str:
    assert cli.main(argv) == status
    err = capsys.readouterr().err
    assert err.startswith("bitmtp: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every case below must be refused before anything loads."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(bitmtp, "load", refuse)
    monkeypatch.setattr(cli_train, "_load", refuse)


MISSING = "/nonexistent-bitmtp-dir/x"

# (argv, substrings the one line must contain: the flag and the fix)
CASES = [
    (["generate", "--threads", "-1"], ["--threads", ">= 1", "-1", "torch's choice"]),
    (["generate", "--threads", "0"], ["--threads", ">= 1"]),
    (["generate", "--threads", "two"], ["--threads", "invalid int value", "generate --help"]),
    (["generate", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--capacity", "-7"], ["--capacity", ">= 1", "--max-new-tokens"]),
    (["generate", "--block-size", "99"], ["--block-size", "2..16", "99"]),
    (["generate", "--block-size", "1"], ["--block-size", "2..16"]),
    (["generate", "--tau", "2"], ["--tau", "(0, 1]", "e.g. 0.9"]),
    (["generate", "--tau", "0"], ["--tau", "(0, 1]"]),
    (["generate", "--tau", "nan"], ["--tau", "nan"]),
    (["generate", "--min-prefix", "-3"], ["--min-prefix", ">= 0"]),
    (["generate", "--cpu-layers", "-1", "--backend", "wgpu"], ["--cpu-layers", ">= 0"]),
    (["generate", "--model", MISSING], ["--model", MISSING, "does not exist", "existing model folder"]),
    (["generate", "--adapter", MISSING], ["--adapter", MISSING, "does not exist"]),
    (["generate", "--adapter", "__file__", "--model", "."], ["--adapter", "not a folder"]),
    (["generate", "--adapter", ".", "--no-adapter"], ["--adapter and --no-adapter", "give one"]),
    (["generate", "--input-ids", "5,6", "--raw"], ["--raw", "drop --raw"]),
    (["generate", "hi", "--input-ids", "5,6"], ["not both"]),
    (["generate", "--vram-budget", "1GB"], ["--vram-budget", "--backend wgpu"]),
    (["generate", "--backend", "gpu"], ["--backend", "unknown backend 'gpu'", "torch", "wgpu", "bitmtp info"]),
    (["generate", "--policy", "fast"], ["--policy", "invalid choice", "generate --help"]),
    (["generate", "--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (["info", "--plan", "--vram-budget", "lots"], ["--vram-budget", "cannot parse 'lots'", "4GiB"]),
    (["generate", "--backend", "wgpu", "--vram-budget", "1.5B"], ["--vram-budget", "whole number of bytes"]),
    (["info", "--capacity", "0"], ["--capacity", ">= 1"]),
    (["info", "--cpu-layers", "-2", "--plan"], ["--cpu-layers", ">= 0"]),
    (["info", "--dense-bytes", "3"], ["--dense-bytes", "invalid choice"]),
    (["info", "--model", MISSING], ["--model", "does not exist"]),
    (["info", "--preset", "smollm2-135m"], ["--preset", "only used by --plan", "add --plan"]),
    (["info", "--model", ".", "--default-model"], ["--default-model", "give one model"]),
    (["convert", "-o", MISSING + "/out.gguf"], ["--output", "does not exist", "mkdir -p"]),
    (["convert", "-o", "out.bin"], ["--output", "should end in .gguf"]),
    (["convert", MISSING, "-o", "x.gguf"], ["source", "does not exist"]),
    (["convert"], ["required", "--output"]),
    (["train", "--out", MISSING + "/ad"], ["--out", "does not exist", "mkdir -p"]),
    (["train", "--out", "ad", "--block-size", "1"], ["--block-size", "2..16"]),
    (["train", "--out", "ad", "--rank", "0"], ["--rank", ">= 1"]),
    (["train", "--out", "ad", "--lr", "0"], ["--lr", "> 0"]),
    (["train", "--out", "ad", "--lr", "inf"], ["--lr", "finite"]),
    (["train", "--out", "ad", "--lora-alpha", "-1"], ["--lora-alpha", "> 0"]),
    (["train", "--out", "ad", "--gamma", "1.5"], ["--gamma", "(0, 1]"]),
    (["train", "--out", "ad", "--seq-len", "6"], ["--seq-len", "at least 10"]),
    (["train", "--out", "ad", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["train", "--out", "ad", "--anchors", "0"], ["--anchors", ">= 1"]),
    (["train", "--out", "ad", "--short-anchors", "-2"], ["--short-anchors", ">= 0"]),
    (["train", "--out", "ad", "--max-steps", "0"], ["--max-steps", ">= 1"]),
    (["train", "--out", "ad", "--max-tokens", "-1"], ["--max-tokens", ">= 1"]),
    (["train", "--out", "ad", "--time-budget", "0"], ["--time-budget", "longer than 0"]),
    (["train", "--out", "ad", "--time-budget", "soon"], ["--time-budget", "like 90s"]),
    (["train", "--out", "ad", "--checkpoint-every", "-1"], ["--checkpoint-every", ">= 0"]),
    (["train", "--out", "ad", "--device", "tpu"], ["--device", "cpu, cuda or cuda:N"]),
    (["train", "--out", "ad", "--threads", "0"], ["--threads", ">= 1"]),
    (["train", "--out", "ad", "--init-from", MISSING], ["--init-from", "does not exist"]),
    (["train", "--out", "ad", "--resume", "--init-from", "."], ["--resume and --init-from", "drop --init-from"]),
    (["train", "--out", "ad", "--resume"], ["--resume", "no checkpoint", "ad.ckpt", "run without --resume"]),
    (["train", "--out", "ad.gguf", "--mode", "full", "--init-from", "."], ["init_from", "--model"]),
    (["train"], ["required", "--out"]),
    (["distill", "--out", MISSING + "/d.jsonl"], ["--out", "does not exist"]),
    (["distill", "--out", "d.jsonl", "--count", "0"], ["--count", ">= 1"]),
    (["distill", "--out", "d.jsonl", "--chat-fraction", "1.5"], ["--chat-fraction", "[0, 1]"]),
    (["distill", "--out", "d.jsonl", "--new-tokens", "0"], ["--new-tokens", ">= 1"]),
    (["distill", "--out", "d.jsonl", "--lines", "0"], ["--lines", ">= 1"]),
    (["distill", "--out", "d.jsonl", "--block-size", "17"], ["--block-size", "2..16"]),
    (["distill", "--out", "d.jsonl", "--resume", "--overwrite"], ["--resume and --overwrite", "give one"]),
    (["distill", "--out", "."], ["--out", "is a folder"]),
    (["eval-acceptance", "--policies", "fast"], ["--policies", "unknown 'fast'", "speculative"]),
    (["eval-acceptance", "--policies", " , "], ["--policies", "at least one"]),
    (["eval-acceptance", "--block-sizes", "4,x"], ["--block-sizes", "'x' is not an integer", "4,8"]),
    (["eval-acceptance", "--block-sizes", "4,99"], ["--block-sizes", "99", "2..16"]),
    (["eval-acceptance", "--prompts", "chat", MISSING], ["--prompts", MISSING, "'code', 'chat'"]),
    (["eval-acceptance", "--count", "0"], ["--count", ">= 1"]),
    (["eval-acceptance", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["bench", "--tau", "1.01"], ["--tau", "(0, 1]"]),
    (["bench", "--plot", MISSING + "/b.png"], ["--plot", "does not exist"]),
    (["bench", "--plot", "b.txt"], ["--plot", ".png or .svg or .pdf"]),
    (["bench", "--adapter", MISSING], ["--adapter", "does not exist"]),
]


@pytest.mark.parametrize("argv, expect", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_argument_is_one_line_and_exit_2(argv, expect, capsys, no_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative outputs ("ad", "d.jsonl") land in an empty folder
    argv = [str(Path(__file__)) if a == "__file__" else a for a in argv]
    err = _one_error_line(capsys, argv)
    for part in expect:
        assert part in err, (part, err)


def test_debug_before_or_after_the_command_raises(no_model):
    for argv in (["--debug", "generate", "--threads", "-1"], ["generate", "--threads", "-1", "--debug"],
                 ["train", "--debug", "--out", "ad", "--rank", "0"]):
        with pytest.raises(BitMTPError, match="--threads|--rank"):
            cli.main(argv)


def test_debug_flag_does_not_leak_between_levels():
    parser = cli.build_parser()
    assert parser.parse_args(["--debug", "info"]).debug is True  # the command's --debug keeps the global one
    assert parser.parse_args(["info", "--debug"]).debug is True
    assert parser.parse_args(["info"]).debug is False


def test_every_option_says_what_it_does(capsys):
    """Each command's --help runs and every option has a help text (the defaults are in them)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"generate", "info", "convert", "train", "distill", "eval-acceptance", "bench"}
    for name, command in sub.choices.items():
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            for flag in action.option_strings:
                assert flag in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "--debug" in out and "exit with status 2" in " ".join(out.split())


def test_unexpected_exception_is_one_line_exit_1(monkeypatch, capsys):
    def boom(args):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(cli_train, "_load", boom)
    err = _one_error_line(capsys, ["eval-acceptance", "--no-progress"], status=1)
    assert "unexpected ZeroDivisionError: division by zero second line" in err and "--debug" in err
    with pytest.raises(ZeroDivisionError):
        cli.main(["eval-acceptance", "--no-progress", "--debug"])


def test_multi_line_bitmtp_error_stays_one_line(monkeypatch, capsys):
    def bad(args):
        raise BitMTPError("--model: first\n  second")

    monkeypatch.setattr(cli_train, "_load", bad)
    assert "bitmtp: error: --model: first second\n" == _one_error_line(capsys, ["bench", "--no-progress"])


def test_interrupt_exits_130_with_resume_hint_only_when_a_checkpoint_exists(monkeypatch, capsys, tmp_path):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_train, "_load", interrupted)
    assert cli.main(["bench", "--no-progress"]) == 130
    assert capsys.readouterr().err == "bitmtp: interrupted\n"
    out = tmp_path / "ad"
    assert cli.main(["train", "--out", str(out), "--no-progress"]) == 130  # no checkpoint yet: no hint
    assert capsys.readouterr().err == "bitmtp: interrupted\n"
    (tmp_path / "ad.ckpt").mkdir()
    (tmp_path / "ad.ckpt" / "state.pt").write_bytes(os.urandom(64))
    assert cli.main(["train", "--out", str(out), "--no-progress"]) == 130
    assert capsys.readouterr().err == "bitmtp: interrupted (continue with the same command plus --resume)\n"


def test_resume_of_a_crafted_checkpoint_is_one_line(monkeypatch, capsys, tmp_path):
    """The CLI face of tests/train/test_resume.py: a checkpoint that would run code → exit 2, one line."""
    import pickle

    import torch

    from tests.support.hf_models import tiny_model

    class Plant:
        def __reduce__(self):
            return open, (str(tmp_path / "marker"), "w")

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("def f(x):\n    return x * 3 + 1\n" * 30)
    (tmp_path / "ad.ckpt").mkdir()
    (tmp_path / "ad.ckpt" / "state.pt").write_bytes(pickle.dumps({"params": Plant()}, protocol=2))
    from tests.support.tokenizers import CharTokenizer

    monkeypatch.setattr(cli_train, "_load", lambda args: bitmtp.load(
        tiny_model("llama", seed=2), capacity=64, tokenizer=CharTokenizer(), adapter=None))
    torch.manual_seed(0)
    assert cli.main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "ad"), "--resume",
                     "--seq-len", "16", "--block-size", "3", "--no-progress"]) == 2
    lines = capsys.readouterr().err.splitlines()  # the "training ..." progress line, then the one error
    assert lines[0].startswith("bitmtp: training") and len(lines) == 2 and "Traceback" not in lines[1]
    err = lines[1]
    assert err.startswith("bitmtp: error: resume (--resume): ")
    assert "state.pt" in err and "not a plain tensor checkpoint" in err
    assert not (tmp_path / "marker").exists()


# --- an interrupted stream ----------------------------------------------------------------------------------


class _Words:
    """A stand-in tokenizer: token t decodes to `` w{t}``; text encodes one id per character."""

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + self(messages[0]["content"])["input_ids"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{t}" for t in ids)


class _Stdout(io.StringIO):
    """stdout whose reader goes away (``exc``) after ``after`` writes."""

    def __init__(self, exc: BaseException, after: int):
        super().__init__()
        self.exc, self.left = exc, after

    def write(self, s: str) -> int:
        if self.left == 0:
            raise self.exc
        self.left -= 1
        return super().write(s)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.support.hf_models import tiny_model

    folder = tmp_path_factory.mktemp("stream") / "m"
    tiny_model("llama", seed=5, initializer_range=0.3).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("exc, status, err", [(KeyboardInterrupt(), 130, "bitmtp: interrupted\n"),
                                              (BrokenPipeError(32, "Broken pipe"), 141, "")])
def test_interrupted_stream_exits_quietly(tiny_folder, monkeypatch, capsys, exc, status, err):
    import bitmtp.api

    load = bitmtp.api.load
    monkeypatch.setattr(bitmtp.api, "load", lambda *a, **kw: load(*a, tokenizer=_Words(), **kw))
    argv = ["generate", "hello", "--model", tiny_folder, "--no-adapter", "--max-new-tokens", "40"]
    assert cli.main(argv) == 0  # the whole stream, for reference
    full = capsys.readouterr().out
    fake = _Stdout(exc, after=3)
    monkeypatch.setattr(sys, "stdout", fake)
    assert cli.main(argv) == status
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    assert capsys.readouterr().err == err  # no traceback, no summary line
    shown = fake.getvalue()
    assert len(shown) > 0 and full.startswith(shown)  # the first pieces, as streamed in full


# --- the real process (one each: they cost an interpreter start) ------------------------------------------

def _run(*argv: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bitmtp", *argv], cwd=ROOT, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300)


def test_process_prints_one_line_and_exits_2():
    proc = _run("generate", "--threads", "-1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "bitmtp: error: --threads: must be >= 1, got -1; leave it out for torch's choice\n"


def test_process_debug_shows_the_traceback():
    proc = _run("generate", "--threads", "-1", "--debug")
    assert proc.returncode == 1  # Python's status for an uncaught exception
    assert "Traceback (most recent call last)" in proc.stderr and "BitMTPError: --threads" in proc.stderr


def test_process_with_closed_stdout_exits_quietly():
    """``bitmtp info | head -c 0``: the reader is gone before the first write; 141 = 128 + SIGPIPE, what a
    shell reports for a program a closed pipe stopped, and nothing on stderr (not even at exit)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = _run("info", stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == ""


# --- advice in the command line's words (issue 42, item 6) ----------------------------------------------

def test_capacity_advice_names_the_flag(tiny_folder, capsys):
    ids = ",".join(str(3 + i % 90) for i in range(40))
    err = _one_error_line(capsys, ["generate", "--model", tiny_folder, "--no-adapter", "--input-ids", ids,
                                   "--capacity", "16", "--max-new-tokens", "8"])
    assert err.startswith("bitmtp: error: --capacity: the prompt of 40 tokens exceeds the KV store's capacity of 16")
    assert "run with --capacity 48 " in err and "--max-new-tokens says" in err and "bitmtp.load" not in err
    import bitmtp.api

    assert not bitmtp.api._COMMAND_LINE.get()  # main() leaves Python callers their own spelling


def test_load_time_capacity_advice_names_the_flag(tiny_folder, capsys, monkeypatch):
    import bitmtp.api

    monkeypatch.setattr(bitmtp.api, "_available_bytes", lambda device: 2**20)
    err = _one_error_line(capsys, ["generate", "--model", tiny_folder, "--no-adapter", "--input-ids", "5,6",
                                   "--capacity", "100000"])
    assert err.startswith("bitmtp: error: --capacity: 100000 tokens need ")
    assert " or less fits" in err and "capacity=" not in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_convert_to_an_unwritable_folder_is_one_line(tiny_folder, capsys):
    assert cli.main(["convert", tiny_folder, "-o", "/proc/x.gguf", "--no-adapter"]) == 2
    lines = capsys.readouterr().err.splitlines()  # "loading ...", then the one error
    assert lines[0].startswith("loading ") and len(lines) == 2 and "Traceback" not in lines[1]
    assert lines[1] == ("bitmtp: error: /proc/x.gguf: cannot create a file in /proc (No such file or directory); "
                        "give a path in a folder you can write to")
