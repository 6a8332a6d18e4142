"""``python -m bitmtp train`` and ``eval-acceptance`` on a tiny model with a stand-in tokenizer."""

from __future__ import annotations

import json

import pytest

import bitmtp
from bitmtp import cli, cli_train
from bitmtp.formats.adapters import load_adapter
from tests.support.adapters import INIT_RANGE
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import CharTokenizer

pytest.importorskip("transformers")


@pytest.fixture
def tiny(monkeypatch):
    def load(args):
        return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256,
                           tokenizer=CharTokenizer(), adapter=getattr(args, "adapter", None))

    monkeypatch.setattr(cli_train, "_load", load)


def test_train_then_eval_acceptance(tiny, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "ad"
    argv = ["train", "--data", str(tmp_path / "data"), "--out", str(out), "--max-steps", "4", "--seq-len", "32",
            "--block-size", "4", "--rank", "2", "--anchors", "4", "--no-progress", "--checkpoint-every", "2"]
    assert cli.main(argv) == 0
    config, _ = load_adapter(out)
    assert config.kind == "mask-block" and config.training["steps"] == 4 and "a.py" not in config.training["data"]
    assert not (tmp_path / "ad.ckpt").exists()
    assert cli.main(argv) == 2  # the output exists
    assert "already exists" in capsys.readouterr().err
    assert cli.main(argv + ["--overwrite", "--mode", "heads"]) == 0
    assert load_adapter(out)[0].kind == "heads"

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nwhat is two plus two\n")
    capsys.readouterr()
    rc = cli.main(["eval-acceptance", "--adapter", str(out), "--prompts", str(prompts), "--policies",
                   "speculative,hybrid,confidence", "--block-sizes", "2,4", "--max-new-tokens", "12", "--json",
                   "--no-progress"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)[str(prompts)]
    assert [(r["policy"], r["block_size"]) for r in rows] == [
        ("speculative", 2), ("speculative", 4), ("hybrid", 2), ("hybrid", 4), ("confidence", 2), ("confidence", 4)]
    for r in rows:
        assert r["mean_committed"] >= 1 and r["prompts"] == 2
        assert (r["identical_to_ar"] is None) == (r["policy"] == "speculative")


def test_train_and_eval_bad_input(tiny, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "empty" in capsys.readouterr().err
    assert cli.main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "x"), "--time-budget", "soon"]) == 2
    assert "--time-budget" in capsys.readouterr().err
    assert cli.main(["eval-acceptance", "--prompts", "chat", "--no-progress"]) == 2  # no adapter
    assert "adapter" in capsys.readouterr().err


def test_parse_duration():
    assert cli_train.parse_duration("90") == 90 and cli_train.parse_duration("20m") == 1200
    assert cli_train.parse_duration("1.5h") == 5400 and cli_train.parse_duration(None) is None


def test_bench_plot_and_info(tiny, tmp_path, capsys, monkeypatch):
    from bitmtp.formats.adapters import save_adapter
    from tests.support.adapters import random_adapter

    args = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), adapter=None).args
    ad = save_adapter(tmp_path / "ad", *random_adapter(args, "mask-block", block_size=8))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nworld\n")
    png = tmp_path / "bench.png"
    rc = cli.main(["bench", "--adapter", str(ad), "--prompts", str(prompts), "--block-sizes", "4",
                   "--max-new-tokens", "10", "--plot", str(png), "--no-progress"])
    assert rc == 0 and png.stat().st_size > 1000
    table = capsys.readouterr().out
    assert "| speculative | 4 |" in table and "| confidence | 4 |" in table
    # info describes a model, its KV plan and its adapter
    folder = tmp_path / "m"
    tiny_model("llama", seed=3).save_pretrained(folder)
    assert cli.main(["info", "--model", str(folder), "--capacity", "100"]) == 0
    out = capsys.readouterr().out
    assert "KV plan: capacity 100 tokens" in out and "adapter: none" in out
    # --debug shows the traceback instead of one line
    with pytest.raises(bitmtp.BitMTPError):
        cli.main(["--debug", "eval-acceptance", "--prompts", "chat", "--no-progress"])


def test_train_full_mode_writes_one_gguf(tiny, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "tuned.gguf"
    argv = ["train", "--mode", "full", "--data", str(tmp_path / "data"), "--out", str(out), "--max-steps", "3",
            "--seq-len", "32", "--block-size", "4", "--anchors", "4", "--no-progress"]
    assert cli.main(argv) == 0
    model = bitmtp.load(out, capacity=128)
    assert model.adapter_config.targets == [] and model.adapter_config.training["steps"] == 3
    assert "full fine-tune" in capsys.readouterr().err
    assert cli.main(argv[:-9] + ["--out", str(tmp_path / "folder"), "--no-progress"]) == 2  # not a .gguf
    assert ".gguf" in capsys.readouterr().err


@pytest.mark.parametrize("flag,expected", [([], False), (["--stop-at-eos"], True)])
def test_eval_acceptance_stop_at_eos_reaches_the_evaluation(tiny, tmp_path, monkeypatch, flag, expected):
    from bitmtp.formats.adapters import save_adapter
    from bitmtp.train import evaluate
    from tests.support.adapters import random_adapter

    seen = {}

    def fake(model, prompts, **kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(evaluate, "evaluate_acceptance", fake)
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, adapter=None)
    adapter = save_adapter(tmp_path / "ad", *random_adapter(m.args, "mask-block", 4))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    assert cli.main(["eval-acceptance", "--adapter", str(adapter), "--prompts", str(prompts), "--json",
                     "--no-progress", *flag]) == 0
    assert seen["stop_at_eos"] is expected
