"""Self-distillation corpora (``bitmtp.train.distill``, ``python -m bitmtp distill``) and JSONL token records."""

from __future__ import annotations

import json

import pytest

import bitmtp
from bitmtp import cli, cli_train
from bitmtp.errors import BitMTPError
from bitmtp.train import token_windows
from bitmtp.train.distill import distill_corpus, distill_prompt_ids, snippet_prompts
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import CharTokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256,
                    tokenizer=CharTokenizer(), adapter=None)
    return m


def _code(tmp_path, files=3, defs=4):
    src = tmp_path / "src"
    src.mkdir()
    for f in range(files):
        body = "".join(f"def f{f}_{i}(x, y):\n    z = x * {i} + y\n    return z - {f}\n\n" for i in range(defs))
        (src / f"m{f}.py").write_text("import os\n\n" + body)
    return src


def test_snippets_come_from_functions_at_most_per_file(tmp_path):
    src = _code(tmp_path)
    out = snippet_prompts([src], count=100, lines=3, per_file=2, seed=1)
    assert len(out) == 6 and all(s.startswith("def f") and s.endswith("\n") for s in out)
    assert len(snippet_prompts([src], count=4, lines=3, per_file=2)) == 4
    (tmp_path / "nodefs").mkdir()
    (tmp_path / "nodefs" / "a.py").write_text("x = 1\n" * 50)
    with pytest.raises(BitMTPError, match="no Python function"):
        snippet_prompts([tmp_path / "nodefs"], count=3)
    with pytest.raises(BitMTPError, match="count"):
        snippet_prompts([src], count=0)


def test_corpus_is_the_models_greedy_continuation(model, tmp_path):
    src = _code(tmp_path)
    chat_head = model.encode([{"role": "user", "content": "x"}])[:6]
    assert all(p[:6] == chat_head for p in distill_prompt_ids(model, [src], count=3, chat_fraction=1.0, lines=3))
    prompts = distill_prompt_ids(model, [src], count=5, chat_fraction=0.0, lines=3, seed=2)
    assert len(prompts) == 5 and not any(p[:6] == chat_head for p in prompts)
    out = tmp_path / "d.jsonl"
    st = distill_corpus(model, prompts, out, max_new_tokens=12, policy="ar", progress=False)
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert st.records == len(recs) == 5 and not out.with_name("d.jsonl.partial").exists()
    for ids, rec in zip(prompts, recs, strict=True):
        assert rec["prompt_tokens"] == len(ids) and rec["tokens"][: len(ids)] == ids
        ar = bitmtp.generate(model, input_ids=ids, max_new_tokens=12, policy="ar", eos_token_id=None)
        assert rec["tokens"][len(ids):] == ar.token_ids
    assert st.generated_tokens == sum(len(r["tokens"]) - r["prompt_tokens"] for r in recs)

    # speculative decoding writes the same records (it is exact)
    model.load_adapter(random_adapter(model.args, "mask-block", 4))
    try:
        spec = tmp_path / "s.jsonl"
        distill_corpus(model, prompts, spec, max_new_tokens=12, policy="speculative", block_size=4, progress=False)
        assert spec.read_text() == out.read_text()
    finally:
        model.load_adapter(None)


def test_existing_output_refused_and_resume_keeps_done_records(model, tmp_path):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    out = tmp_path / "d.jsonl"
    out.write_text("keep me\n")
    with pytest.raises(BitMTPError, match="exists"):
        distill_corpus(model, prompts, out, max_new_tokens=4, progress=False)
    assert out.read_text() == "keep me\n"
    out.unlink()
    partial = tmp_path / "d.jsonl.partial"
    first = {"tokens": [5, 6, 7, 8, 1, 2], "prompt_tokens": 4}
    partial.write_text(json.dumps(first) + "\n")  # an interrupted run's first record
    st = distill_corpus(model, prompts, out, max_new_tokens=4, resume=True, progress=False)
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert st.records == 3 and recs[0] == first and recs[1]["tokens"][:3] == [9, 10, 11]
    # without resume a stale partial file is started over
    partial.write_text(json.dumps(first) + "\n")
    distill_corpus(model, prompts, out, max_new_tokens=4, overwrite=True, progress=False)
    assert json.loads(out.read_text().splitlines()[0])["tokens"][:4] == [5, 6, 7, 8] != first["tokens"]
    with pytest.raises(BitMTPError, match="exact policy"):
        distill_corpus(model, prompts, tmp_path / "h.jsonl", policy="hybrid", progress=False)
    with pytest.raises(BitMTPError, match="empty"):
        distill_corpus(model, [], tmp_path / "e.jsonl", progress=False)
    with pytest.raises(BitMTPError, match="chat_fraction"):
        distill_prompt_ids(model, ["stdlib"], 3, chat_fraction=1.5)


def test_token_records_train_as_they_are(tmp_path):
    ids = list(range(3, 43))
    (tmp_path / "c.jsonl").write_text(json.dumps({"tokens": ids, "prompt_tokens": 5}) + "\n")
    w = token_windows([tmp_path / "c.jsonl"], CharTokenizer(), 16, max_context=128, eos_token_id=2, vocab_size=100)
    assert w[0] == ids[:16] and w[1] == ids[16:32]
    with pytest.raises(BitMTPError, match="vocabulary"):
        token_windows([tmp_path / "c.jsonl"], CharTokenizer(), 16, max_context=128, vocab_size=20)
    for bad in ([1, -2, 3], [1, "a"], [], [True, 2]):
        (tmp_path / "b.jsonl").write_text(json.dumps({"tokens": bad}) + "\n")
        with pytest.raises(BitMTPError, match="token ids"):
            token_windows([tmp_path / "b.jsonl"], CharTokenizer(), 8, max_context=128)


def test_cli_distill_then_train(monkeypatch, tmp_path, capsys):
    def load(args):
        m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256,
                        tokenizer=CharTokenizer(), adapter=None)
        if getattr(args, "adapter", None):
            m.load_adapter(args.adapter)
        return m

    monkeypatch.setattr(cli_train, "_load", load)
    src = _code(tmp_path)
    out = tmp_path / "d.jsonl"
    argv = ["distill", "--data", str(src), "--out", str(out), "--count", "4", "--new-tokens", "8", "--lines", "3",
            "--no-progress"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "with ar" in err and "4 records" in err  # no adapter: plain AR
    assert len(out.read_text().splitlines()) == 4
    assert cli.main(argv) == 2 and "exists" in capsys.readouterr().err
    ad = tmp_path / "ad"
    assert cli.main(["train", "--data", str(out), "--out", str(ad), "--mode", "heads", "--max-steps", "2",
                     "--seq-len", "16", "--block-size", "3", "--rank", "2", "--anchors", "2", "--no-progress"]) == 0
    assert "d.jsonl" in json.loads((ad / "adapter_config.json").read_text())["training"]["data"]


def test_transformers_engine_writes_the_same_records_in_batches(model, tmp_path):
    """--engine transformers: the same weights through transformers' batched generate (left padding, prompts of
    different lengths, a short last batch, continuations cut after their end-of-sequence token) write the records
    bitmtp's own AR greedy writes, token for token, in the same file format."""
    from bitmtp.train.distill import distill_corpus_hf, hf_greedy

    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    # a checkpoint's generation defaults must not turn greedy into something else
    hf.generation_config.repetition_penalty, hf.generation_config.no_repeat_ngram_size = 1.5, 2
    prompts = distill_prompt_ids(model, [_code(tmp_path)], count=5, chat_fraction=0.5, lines=3, seed=4)
    prompts = [p[: 12 + 9 * i] for i, p in enumerate(prompts)]  # five lengths: left padding is exercised
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    distill_corpus(model, prompts, ours, max_new_tokens=12, policy="ar", progress=False)
    st = distill_corpus_hf(hf, prompts, theirs, eos_ids=model.eos_ids(None), max_new_tokens=12, batch_size=2,
                           progress=False)
    assert st.records == 5 and theirs.read_text() == ours.read_text()
    assert hf.generation_config.repetition_penalty == 1.5  # set aside for the call only
    # a continuation stops after the first end-of-sequence id, which it keeps (as bitmtp.generate does)
    first = json.loads(ours.read_text().splitlines()[0])
    gen = first["tokens"][first["prompt_tokens"]:]
    eos = gen[2]
    cut = hf_greedy(hf, [prompts[0]], max_new_tokens=12, eos_ids=[eos])[0]
    assert cut == gen[:gen.index(eos) + 1]
    with pytest.raises(BitMTPError, match="batch_size"):
        distill_corpus_hf(hf, prompts, tmp_path / "x.jsonl", eos_ids=[eos], batch_size=0, progress=False)
    with pytest.raises(BitMTPError, match="eos_ids"):
        distill_corpus_hf(hf, prompts, tmp_path / "x.jsonl", eos_ids=[], progress=False)
    with pytest.raises(BitMTPError, match="at least one token"):
        hf_greedy(hf, [prompts[0], []], max_new_tokens=4, eos_ids=[eos])
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.partial").exists()


@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_transformers_engine_sorts_each_chunk_by_length_and_keeps_the_order(monkeypatch, tmp_path, chunk):
    """Batches are cut from length-sorted chunks of SORT_CHUNK batches (less left padding), and each chunk's
    records are written in the prompts' own order: the file is the one an unsorted run writes."""
    import random

    from bitmtp.train import distill

    rng = random.Random(chunk)
    prompts = [[rng.randrange(3, 50) for _ in range(n)] for n in (9, 3, 7, 1, 5, 11, 2, 8, 4)]
    calls = []

    def fake_greedy(hf, batch, *, max_new_tokens, eos_ids):
        calls.append([len(p) for p in batch])
        return [[p[0], len(p)] for p in batch]  # a continuation that names its prompt

    monkeypatch.setattr(distill, "hf_greedy", fake_greedy)
    monkeypatch.setattr(distill, "SORT_CHUNK", chunk)
    out = tmp_path / "c.jsonl"
    distill.distill_corpus_hf(None, prompts, out, eos_ids=[2], batch_size=2, progress=False)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in recs] == [p + [p[0], len(p)] for p in prompts]
    assert all(len(c) <= 2 for c in calls) and sum(map(len, calls)) == len(prompts)
    per_chunk = 2 * chunk
    for lo in range(0, len(prompts), per_chunk):  # within a chunk: batches in ascending length, none overlapping
        lens = [n for c in calls for n in c][lo:lo + per_chunk]
        assert lens == sorted(len(p) for p in prompts[lo:lo + per_chunk])


def test_cli_distill_with_the_transformers_engine(monkeypatch, tmp_path, capsys):
    folder = tmp_path / "hf"
    tiny_model("llama", seed=3, initializer_range=INIT_RANGE).save_pretrained(folder)
    monkeypatch.setattr(cli_train, "_load", lambda args: bitmtp.load(
        str(args.model), capacity=256, tokenizer=CharTokenizer(), adapter=None))
    src = _code(tmp_path)
    argv = ["distill", "--data", str(src), "--count", "3", "--new-tokens", "6", "--lines", "3", "--no-progress",
            "--model", str(folder)]
    assert cli.main([*argv, "--out", str(tmp_path / "a.jsonl")]) == 0
    assert cli.main([*argv, "--out", str(tmp_path / "b.jsonl"), "--engine", "transformers", "--batch-size", "2"]) == 0
    assert "transformers' generate, 2 a call on cpu" in capsys.readouterr().err
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model")
    monkeypatch.setattr(cli_train, "_load", lambda args: bitmtp.load(
        str(folder), capacity=256, tokenizer=CharTokenizer(), adapter=None))
    assert cli.main(["distill", "--data", str(src), "--count", "2", "--new-tokens", "4", "--lines", "3",
                     "--no-progress", "--model", str(bad), "--out", str(tmp_path / "c.jsonl"),
                     "--engine", "transformers"]) == 2
    assert "neither a .gguf file nor a Hugging Face folder" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()


@pytest.mark.slow
def test_transformers_engine_matches_bitmtp_on_smollm2(tmp_path):
    """The real model (its Q4_1 GGUF, which transformers dequantizes to the same float32 weights): four general
    chat prompts x 160 tokens, batched, give bitmtp's own greedy records."""
    pytest.importorskip("gguf")
    from bitmtp.cli_train import _load_transformers
    from bitmtp.train.distill import distill_corpus_hf
    from tests.support.smollm2 import smollm2_or_skip

    path = smollm2_or_skip()
    ours_model = bitmtp.load(path, adapter=None)
    prompts = distill_prompt_ids(ours_model, count=4, general_fraction=1.0)
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    distill_corpus(ours_model, prompts, ours, max_new_tokens=160, policy="ar", progress=False)
    distill_corpus_hf(_load_transformers(str(path), "cpu"), prompts, theirs, eos_ids=ours_model.eos_ids(None),
                      max_new_tokens=160, batch_size=4, progress=False)
    assert theirs.read_text() == ours.read_text()
