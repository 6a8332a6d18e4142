"""General chat prompts for distillation (``bitmtp.train.chat_prompts``) and ``distill --general-fraction``."""

from __future__ import annotations

import json
import re

import pytest

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.train.chat_prompts import ANSWER_SHAPES, EXCLUDED_WORDS, _banned, all_chat_prompts, chat_prompts
from bitmtp.train.distill import corpus_prompts, distill_prompt_ids
from bitmtp.train.evaluate import CHAT_PROMPTS
from tests.support.adapters import INIT_RANGE
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import CharTokenizer


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4}


def test_set_is_large_distinct_and_deterministic():
    pool = all_chat_prompts()
    assert len(pool) >= 300 and len(set(pool)) == len(pool)
    a, b = chat_prompts(50, seed=3), chat_prompts(50, seed=3)
    assert a == b and len(set(a)) == 50 and set(a) <= set(pool)
    assert chat_prompts(50, seed=4) != a
    assert sorted(chat_prompts(len(pool))) == sorted(pool)
    assert chat_prompts(None, seed=3) == chat_prompts(len(pool), seed=3) and chat_prompts(None, seed=3)[:50] == a
    for bad in (0, len(pool) + 1):
        with pytest.raises(BitMTPError, match="count"):
            chat_prompts(bad)


@pytest.mark.parametrize("name", ["xl", "xxl"])
def test_eval_chat_prompts_stay_held_out(name):
    pool = all_chat_prompts(name)
    assert not set(pool) & set(CHAT_PROMPTS)
    # every eval prompt names a topic or request form on the exclusion list ...
    for q in CHAT_PROMPTS:
        assert any(w in f" {q.lower()} " for w in EXCLUDED_WORDS), q
    # ... and no training prompt does, nor shares more than a question form with one
    for p in pool:
        assert not any(w in f" {p.lower()} " for w in EXCLUDED_WORDS), p
        assert all(len(_words(p) & _words(q)) <= 3 for q in CHAT_PROMPTS), p


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("transformers")
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256,
                       tokenizer=CharTokenizer(), adapter=None)


def _code(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in range(3):
        (src / f"m{f}.py").write_text("".join(f"def f{f}_{i}(x, y):\n    z = x * {i} + y\n    return z - {f}\n\n"
                                              for i in range(4)))
    return src


def test_general_fraction_mixes_general_questions_into_the_prompts(model, tmp_path):
    src = _code(tmp_path)
    general = {tuple(model.encode([{"role": "user", "content": q}])) for q in all_chat_prompts()}
    code_only = distill_prompt_ids(model, [src], count=6, chat_fraction=0.0, lines=3, seed=1)
    assert code_only == distill_prompt_ids(model, [src], count=6, chat_fraction=0.0, lines=3, seed=1,
                                           general_fraction=0.0)  # the default is the old behaviour
    mixed = distill_prompt_ids(model, [src], count=6, chat_fraction=0.0, lines=3, seed=1, general_fraction=0.5)
    assert len(mixed) == 6 and sum(tuple(p) in general for p in mixed) == 3
    assert sorted(p for p in mixed if tuple(p) not in general) == sorted(code_only[:3])
    assert mixed == distill_prompt_ids(model, [src], count=6, chat_fraction=0.0, lines=3, seed=1,
                                       general_fraction=0.5)
    # all general: no code source is read at all
    only = distill_prompt_ids(model, [tmp_path / "missing"], count=4, seed=2, general_fraction=1.0)
    assert len(only) == 4 and all(tuple(p) in general for p in only)
    with pytest.raises(BitMTPError, match="general_fraction"):
        distill_prompt_ids(model, [src], count=4, general_fraction=1.5)


def test_cli_distill_general_fraction(monkeypatch, tmp_path, capsys, model):
    from bitmtp import cli, cli_train

    monkeypatch.setattr(cli_train, "_load", lambda args: model)
    out = tmp_path / "d.jsonl"
    assert cli.main(["distill", "--data", str(_code(tmp_path)), "--out", str(out), "--count", "4", "--new-tokens",
                     "3", "--lines", "3", "--general-fraction", "0.5", "--no-progress"]) == 0
    assert "4 records" in capsys.readouterr().err
    assert cli.main(["distill", "--out", str(tmp_path / "e.jsonl"), "--general-fraction", "2"]) == 2
    assert "--general-fraction" in capsys.readouterr().err


def test_pools_are_frozen_and_each_extends_the_last():
    # base, wide and xl are what the shipped adapter's corpora drew from: their provenance commands
    # (`distill --general-pool base|wide|xl ...`) reproduce them only while they stay exactly as they were
    import hashlib

    base, wide, xl = all_chat_prompts("base"), all_chat_prompts("wide"), all_chat_prompts("xl")
    assert hashlib.sha256("\n".join(base).encode()).hexdigest() == (
        "9d42a248e849c612a2dc852dc130e19be02c378bab3f89df768e33a929eb244b")
    assert hashlib.sha256("\n".join(wide).encode()).hexdigest() == (
        "2b7f2cb0bbd06dd5ab43fcf851a7fbd9ec0378a6b2ff3b633da81b0f6a44fad2")
    # xl too, since session 10's corpus (mix6) drew from it: more prompts go into a new pool
    assert hashlib.sha256("\n".join(xl).encode()).hexdigest() == (
        "55a87cee57f5af97ff8ce0132a510c5f12acfb0634d25c30b46a2f6c41631cf1")
    assert wide[: len(base)] == base and len(wide) >= 1500 and len(set(wide)) == len(wide)
    assert xl[: len(wide)] == wide and len(xl) >= 3000 and len(set(xl)) == len(xl)
    assert all_chat_prompts() == xl and chat_prompts(40, seed=5) == chat_prompts(40, seed=5, pool="xl")
    # xxl (session 14): xl, then every xl prompt with each answer shape appended; frozen from its first corpus on
    xxl = all_chat_prompts("xxl")
    assert hashlib.sha256("\n".join(xxl).encode()).hexdigest() == (
        "6ae5d9b56ac754f86e971d7e9ba6cbdafec54c5933f59d147285a53c2fe7cb14")
    assert xxl[: len(xl)] == xl and len(xxl) == len(xl) * (1 + len(ANSWER_SHAPES)) and len(set(xxl)) == len(xxl)
    assert all(p.endswith(ANSWER_SHAPES) for p in xxl[len(xl):]) and not any(map(_banned, xxl))
    assert set(chat_prompts(40, seed=5, pool="base")) <= set(base)
    for bad in ("", "narrow"):
        with pytest.raises(BitMTPError, match="pool"):
            chat_prompts(3, pool=bad)


def _write_corpus(path, prompts):
    path.write_text("".join(json.dumps({"tokens": list(p) + [5, 6], "prompt_tokens": len(p)}) + "\n"
                            for p in prompts))
    return path


def test_exclude_skips_the_prompts_of_earlier_corpora(model, tmp_path):
    src = _code(tmp_path)
    first = distill_prompt_ids(model, [src], count=8, chat_fraction=0.5, lines=3, seed=1, general_fraction=0.5)
    corpus = _write_corpus(tmp_path / "first.jsonl", first[:5])
    excluded = corpus_prompts([corpus])
    assert excluded == first[:5]
    second = distill_prompt_ids(model, [src], count=8, chat_fraction=0.5, lines=3, seed=1, general_fraction=0.5,
                                exclude=excluded)
    assert len(second) == 8 and not {tuple(p) for p in second} & {tuple(p) for p in first[:5]}
    # what was not excluded is still drawn in the same seeded order
    assert {tuple(p) for p in first[5:]} <= {tuple(p) for p in second}
    general = distill_prompt_ids(model, [tmp_path / "missing"], count=6, seed=2, general_fraction=1.0,
                                 general_pool="base")
    with pytest.raises(BitMTPError, match="general_fraction: the 'base' .* not in the excluded"):
        distill_prompt_ids(model, [tmp_path / "missing"], count=len(all_chat_prompts("base")), seed=2,
                           general_fraction=1.0, general_pool="base", exclude=general)
    with pytest.raises(BitMTPError, match="exclude: only .* code prompts"):
        distill_prompt_ids(model, [src], count=12, chat_fraction=0.0, lines=3, seed=1,
                           exclude=distill_prompt_ids(model, [src], count=12, chat_fraction=0.0, lines=3, seed=1))


def test_corpus_prompts_refuses_what_is_not_a_corpus(tmp_path):
    with pytest.raises(BitMTPError, match="exclude: cannot read .*missing.jsonl"):
        corpus_prompts([tmp_path / "missing.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2], "prompt_tokens": 1}\n{"tokens": [1], "prompt_tokens": 4}\n')
    with pytest.raises(BitMTPError, match="line 2 of .*bad.jsonl is not a distillation record"):
        corpus_prompts([bad])
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(BitMTPError, match="UTF-8"):
        corpus_prompts([binary])


def test_cli_distill_exclude_and_pool(monkeypatch, tmp_path, capsys, model):
    from bitmtp import cli, cli_train

    monkeypatch.setattr(cli_train, "_load", lambda args: model)
    first = tmp_path / "a.jsonl"
    base = ["distill", "--count", "4", "--new-tokens", "2", "--general-fraction", "1", "--general-pool", "base",
            "--no-progress", "--seed", "3"]
    assert cli.main(base + ["--out", str(first)]) == 0
    second = tmp_path / "b.jsonl"
    assert cli.main(base + ["--out", str(second), "--exclude-prompts-of", str(first)]) == 0
    capsys.readouterr()
    a, b = corpus_prompts([first]), corpus_prompts([second])
    assert len(a) == len(b) == 4 and not {tuple(p) for p in a} & {tuple(p) for p in b}
    assert {tuple(p) for p in a} <= {tuple(model.encode([{"role": "user", "content": q}]))
                                     for q in all_chat_prompts("base")}
    assert cli.main(base + ["--out", str(tmp_path / "c.jsonl"), "--exclude-prompts-of",
                            str(tmp_path / "nope.jsonl")]) == 2
    assert "--exclude-prompts-of" in capsys.readouterr().err and not (tmp_path / "c.jsonl").exists()
    assert cli.main(base[:7] + ["--general-pool", "narrow", "--out", str(tmp_path / "d.jsonl")]) == 2
    assert "invalid choice: 'narrow'" in capsys.readouterr().err
