"""bench/gpu_chat_drafts.py's own logic, checked here so its one device run is not where a bug shows: the batches
cover every prompt once, sorted by length and in a seeded order; the corpus comes back in parts under the device
tool's size limit that reassemble to the same bytes."""

from __future__ import annotations

import json
import lzma
import random
import re

import pytest

from bench import gpu_chat_drafts as cd


@pytest.mark.parametrize("n,batch", [(1, 4), (15, 4), (16, 4), (1000, 64), (37, 1)])
def test_length_batches_cover_every_prompt_once_sorted_by_length(n, batch):
    rng = random.Random(n)
    lengths = [rng.randint(1, 300) for _ in range(n)]
    batches = cd.length_batches(lengths, batch, seed=3)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(n))
    assert all(1 <= len(b) <= batch for b in batches) and len(batches) == -(-n // batch)
    spans = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches)
    assert all(hi <= nxt_lo for (_, hi), (nxt_lo, _) in zip(spans, spans[1:], strict=False))  # no overlap


def test_length_batches_order_is_seeded():
    rng = random.Random(1)
    lengths = [rng.randint(1, 300) for _ in range(640)]
    a, b = cd.length_batches(lengths, 16, seed=0), cd.length_batches(lengths, 16, seed=0)
    assert a == b
    assert cd.length_batches(lengths, 16, seed=1) != a
    assert a != sorted(a, key=lambda x: lengths[x[0]])  # not simply shortest first: a cut run keeps a mix


def test_compress_parts_fit_and_reassemble(tmp_path, monkeypatch):
    monkeypatch.setattr(cd, "PART_BYTES", 4096)
    rng = random.Random(7)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"tokens": [rng.randrange(49152) for _ in range(200)],
                                          "prompt_tokens": 40}) + "\n" for _ in range(60)))
    out = tmp_path / "out"
    out.mkdir()
    parts = cd.compress(corpus, out)
    assert len(parts) > 1 and sorted(p.name for p in out.iterdir()) == parts
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p) for p in parts)  # names the device tool brings back
    assert all((out / p).stat().st_size <= 4096 for p in parts)
    assert lzma.decompress(b"".join((out / p).read_bytes() for p in parts)) == corpus.read_bytes()
