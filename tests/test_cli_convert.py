"""``python -m bitmtp convert`` keeps the source's quantization and never leaves a partial file.

* Dense projections and embeddings that a GGUF source stores as Q4_0 / Q4_1 / Q8_0 blocks are written back
  as the same blocks, byte for byte (the source blocks here come from gguf-py's own quantizer, an
  independent encoder), including fused q/k/v and gate/up whose parts differ in format and llama's
  permuted q/k rows; the converted file loads bit-identical to the source.
* A convert stopped by an exception, KeyboardInterrupt, SIGTERM or SIGHUP in the middle of writing the
  tensor data leaves neither its temporary file nor an output file.
* The real SmolLM2 Q4_1 file converts to within 1.2x its size and loads to the same greedy tokens (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import bitmtp
from bitmtp import cli
from bitmtp.formats import gguf as G
from bitmtp.model.decoder import StepInputs
from bitmtp.runtime import KVStore
from tests.support.convert import float_source, slow_at, stalling
from tests.support.paths import REPO_ROOT

gguf = pytest.importorskip("gguf")

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _full_logits(decoder, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` in one causal step."""
    a = decoder.args
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 64, 16)
    pos = torch.arange(len(ids))
    return decoder(StepInputs(torch.tensor(ids), pos, torch.arange(64)[None, :] <= pos[:, None]), kv)


def _quantized_source(tmp_path: Path, family: str, tied: bool, seed: int) -> tuple[Path, dict[str, str]]:
    """The float source with its 2-D weights re-quantized by gguf-py to a random mix of Q4_0 / Q4_1 / Q8_0
    (fused groups get different formats on purpose); returns the file and each tensor's type."""
    contents = G.read_gguf(float_source(tmp_path / "float.gguf", family, tied, seed))
    rng = np.random.default_rng(seed)
    outs, types = [], {}
    for name, t in contents.tensors.items():
        data = np.asarray(t.data)
        kind = "F32"
        if len(t.shape) == 2:  # projections, the embedding and an untied LM head
            kind = str(rng.choice(BLOCK_TYPES))
            data = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType[kind])
        types[name] = kind
        outs.append(G.TensorOut(name, data, None if kind == "F32" else kind))
    layer0 = [types[f"blk.0.{p}.weight"] for p in PROJECTIONS]
    if len(set(layer0)) == 1:  # make sure the fused q/k/v of layer 0 mixes formats
        return _quantized_source(tmp_path, family, tied, seed + 1)
    path = tmp_path / "source.gguf"
    fields = {k: v for k, v in contents.fields.items() if k != "general.architecture"}
    return G.write_gguf(path, contents.architecture, fields.items(), outs), types


def _base(contents: G.GGUFContents) -> dict[str, G.GGUFTensor]:
    return {n: t for n, t in contents.tensors.items() if not n.startswith("bitmtp.")}


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3", True)])
@pytest.mark.parametrize("dense_blocks", ["1", "0"])
def test_convert_writes_the_source_blocks_byte_for_byte(family, tied, dense_blocks, tmp_path, monkeypatch,
                                                        capsys):
    """dense_blocks=0: the decoder keeps no block copies (BITMTP_DENSE_BLOCKS=0), export fits them itself."""
    seed = int.from_bytes(os.urandom(2), "little")
    print("seed", seed)
    src, types = _quantized_source(tmp_path, family, tied, seed)
    monkeypatch.setenv("BITMTP_DENSE_BLOCKS", dense_blocks)
    out = tmp_path / "converted.gguf"
    assert cli.main(["convert", str(src), "-o", str(out), "--no-adapter"]) == 0
    printed = capsys.readouterr().out
    for kind in set(types.values()):
        assert f"{kind} x{sum(v == kind for v in types.values())}" in printed, printed

    source, converted = G.read_gguf(src), G.read_gguf(out)
    assert {n: t.type_name for n, t in _base(converted).items()} == types
    for name, t in _base(source).items():
        assert np.array_equal(np.asarray(converted.tensors[name].data).view(np.uint8),
                              np.asarray(t.data).view(np.uint8)), name
    assert out.stat().st_size <= src.stat().st_size + 16384  # metadata apart, the same bytes

    monkeypatch.setenv("BITMTP_DENSE_BLOCKS", "1")
    a, b = bitmtp.load(src, adapter=None), bitmtp.load(out, adapter=None)
    sa, sb = a.decoder.state_dict(), b.decoder.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    ids = torch.randint(3, 97, (12,)).tolist()
    assert torch.equal(_full_logits(a.decoder, ids), _full_logits(b.decoder, ids))
    assert b.generate_ar(ids, 16, eos_token_id=[]).tokens == a.generate_ar(ids, 16, eos_token_id=[]).tokens
    assert b.decoder.dense_summary()["formats"] == a.decoder.dense_summary()["formats"]


def test_float_models_stay_float(tmp_path):
    """A float32 model whose weights no block format reproduces is written as F32 (nothing is quantized)."""
    src = float_source(tmp_path / "f.gguf", "llama", False, seed=3)
    model = bitmtp.load(src, adapter=None)
    out = model.save_gguf(tmp_path / "out.gguf", progress=False)
    assert {t.type_name for t in _base(G.read_gguf(out)).values()} == {"F32"}


# --- interrupted writes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def float_file(tmp_path_factory) -> Path:
    return float_source(tmp_path_factory.mktemp("src") / "src.gguf", "llama", False, seed=5)


@pytest.fixture
def default_fatal_signals():
    """SIGTERM and SIGHUP at their default action during the test, restored after: under ``nohup`` SIGHUP
    starts ignored, and the writer rightly leaves an ignored signal ignored (see the test below)."""
    saved = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("mode", ["exception", "SIGINT", "SIGTERM", "SIGHUP"])
def test_interrupted_convert_leaves_no_file(mode, float_file, tmp_path, monkeypatch, capsys, default_fatal_signals):
    """In process: the write fails or is signalled after half of a tensor's bytes reached the temporary file."""
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "out.gguf"
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    monkeypatch.setattr(G, "numpy_of", slow_at(4, stalling(mode)))
    argv = ["convert", str(float_file), "-o", str(out), "--no-adapter"]
    if mode in ("SIGTERM", "SIGHUP"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 128 + getattr(signal, mode)  # the status a signal death reports
    else:
        assert cli.main(argv) == (2 if mode == "exception" else 130)
        err = capsys.readouterr().err
        want = "--output: cannot write" if mode == "exception" else "interrupted"
        assert want in err.strip().splitlines()[-1] and "Traceback" not in err, err  # one line, no traceback
    assert list(folder.iterdir()) == [], "a temporary or partial file was left"
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored


def test_an_ignored_sighup_stays_ignored(float_file, tmp_path, monkeypatch):
    """Under ``nohup`` (SIGHUP ignored) a hang-up must not stop the write: the writer only turns signals left at
    their default action into a clean exit, so the file is completed and the disposition is unchanged."""
    out = tmp_path / "out.gguf"
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        real = G.numpy_of
        raised = []

        def numpy_of(t):
            if not raised:
                raised.append(1)
                signal.raise_signal(signal.SIGHUP)  # ignored: nothing happens
            return real(t)

        monkeypatch.setattr(G, "numpy_of", numpy_of)
        assert cli.main(["convert", str(float_file), "-o", str(out), "--no-adapter"]) == 0
        assert raised and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, saved)
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["out.gguf"]
    assert G.read_gguf(out) is not None


_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from bitmtp import cli
    from bitmtp.formats import gguf as G
    from tests.support.convert import slow_at, stalling

    src, out, marker = sys.argv[1:4]
    G.numpy_of = slow_at(4, stalling("wait", Path(marker)))
    sys.exit(cli.main(["convert", src, "-o", out, "--no-adapter"]))
""")


def test_sigterm_from_outside_mid_write_leaves_no_file(float_file, tmp_path):
    """A convert process killed with SIGTERM (as `kill`, systemd or a CI timeout do) while it writes."""
    folder = tmp_path / "out"
    folder.mkdir()
    out, marker = folder / "out.gguf", tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(float_file), str(out), str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # a hang guard only: the marker comes as soon as the child writes
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child never reached the tensor data"
            time.sleep(0.05)
        temps = list(folder.iterdir())
        assert len(temps) == 1 and temps[0].name.endswith(".tmp") and temps[0].stat().st_size > 0  # mid-write
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(folder.iterdir()) == [], "a temporary or partial file was left"


def test_signal_handlers_are_restored(float_file, tmp_path):
    """The write installs its handlers only while it runs, and leaves a program's own handler alone."""
    before = signal.getsignal(signal.SIGTERM)
    model = bitmtp.load(float_file, adapter=None)
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    model.save_gguf(tmp_path / "a.gguf", progress=False)
    assert signal.getsignal(signal.SIGTERM) == before
    signal.signal(signal.SIGTERM, mine)
    try:
        hook = []
        real = G.numpy_of

        def numpy_of(t):  # runs during the write: the program's handler is still in place
            hook.append(signal.getsignal(signal.SIGTERM))
            return real(t)

        G.numpy_of = numpy_of
        try:
            model.save_gguf(tmp_path / "b.gguf", progress=False)
        finally:
            G.numpy_of = real
        assert hook and all(h is mine for h in hook)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


# --- the real model ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_convert_smollm2_keeps_q4_1(tmp_path):
    from tests.support.smollm2 import smollm2_or_skip

    src = smollm2_or_skip()
    out = tmp_path / "smollm2.gguf"
    assert cli.main(["convert", str(src), "-o", str(out)]) == 0
    size_src, size_out = src.stat().st_size, out.stat().st_size
    print(f"source {size_src / 2**20:.1f} MiB, converted {size_out / 2**20:.1f} MiB")
    assert size_out <= 1.2 * size_src
    source, converted = G.read_gguf(src), G.read_gguf(out)
    for name, t in source.tensors.items():
        c = converted.tensors[name]
        assert c.type_name == t.type_name, name
        assert np.array_equal(np.asarray(c.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), name
    assert json.loads(converted.meta["bitmtp.speculative.config"])["kind"]  # the shipped adapter travelled
    a, b = bitmtp.load(src, capacity=256, adapter=None), bitmtp.load(out, capacity=256, adapter=None)
    ids = a.encode([{"role": "user", "content": "What is the capital of France?"}])
    assert b.generate_ar(ids, 32, eos_token_id=[]).tokens == a.generate_ar(ids, 32, eos_token_id=[]).tokens
