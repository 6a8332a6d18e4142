"""The llama.cpp peer harness (bench/llama_cpp.py, bench/peer.py): build options from CPU flags, the
cache key, clear PeerUnavailable reasons, and bitmtp's side of each figure on a tiny model. Building and
running llama-bench itself is the full-mode benchmark's job (bench/e2e/test_bench_peer.py)."""

from __future__ import annotations

import platform

import pytest

from bench import llama_cpp
from bench.peer import FIGURES, PeerRow, bitmtp_measure, format_table

X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.skipif(not X86, reason="x86 ISA options")
def test_isa_options_follow_the_cpu_flags_never_native_never_amx():
    avx2 = llama_cpp.isa_options({"avx", "avx2", "fma", "f16c", "sse4_2"})
    assert avx2["GGML_NATIVE"] == "OFF" and avx2["GGML_AVX2"] == "ON" and avx2["GGML_AVX512"] == "OFF"
    full = llama_cpp.isa_options({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                                  "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"})
    assert full["GGML_AVX512"] == full["GGML_AVX512_VNNI"] == full["GGML_AVX512_BF16"] == "ON"
    assert full["GGML_AMX_TILE"] == full["GGML_AMX_INT8"] == "OFF"  # listed is not enabled on these VMs
    partial = llama_cpp.isa_options({"avx2", "avx512f"})  # AVX-512 needs F, BW, DQ and VL
    assert partial["GGML_AVX512"] == "OFF"


def test_build_key_changes_with_options_and_compiler():
    a = llama_cpp.build_key({"GGML_AVX2": "ON"}, "g++ 13")
    assert a == llama_cpp.build_key({"GGML_AVX2": "ON"}, "g++ 13")
    assert a != llama_cpp.build_key({"GGML_AVX2": "OFF"}, "g++ 13")
    assert a != llama_cpp.build_key({"GGML_AVX2": "ON"}, "g++ 14")


def test_missing_tools_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("BITMTP_PEER_DIR", str(tmp_path))
    real = llama_cpp.shutil.which
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None if name == "cmake" else real(name))
    if real("c++") or real("g++") or real("clang++"):
        with pytest.raises(llama_cpp.PeerUnavailable, match="cmake is not installed"):
            llama_cpp.ensure_llama_bench()
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None)
    with pytest.raises(llama_cpp.PeerUnavailable, match="no C.. compiler"):
        llama_cpp.ensure_llama_bench()
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_each_tool_has_its_own_cached_binary_and_unknown_tools_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("BITMTP_PEER_DIR", str(tmp_path))
    opts = {"GGML_AVX2": "ON"}
    if not (llama_cpp.shutil.which("c++") or llama_cpp.shutil.which("g++") or llama_cpp.shutil.which("clang++")):
        pytest.skip("no C++ compiler: the cache key names the compiler")
    bench, server = (llama_cpp.binary_path(opts, t) for t in llama_cpp.TOOLS)
    assert bench.name == "llama-bench" and server.name == "llama-server" and bench.parent != server.parent
    with pytest.raises(ValueError, match="tool: one of"):
        llama_cpp.ensure_llama_tool("llama-cli")
    assert not list(tmp_path.iterdir())


def test_failing_binary_raises_with_its_message(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(llama_cpp.PeerUnavailable, match="rc 3.*failed to load model"):
        llama_cpp.llama_bench(fake, tmp_path / "m.gguf", threads=1, gen=8)


def test_fake_binary_json_is_parsed(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho '[{\"n_prompt\": 0, \"n_gen\": 8, \"n_depth\": 0, \"avg_ts\": 123.5}]'\n")
    fake.chmod(0o755)
    rec = llama_cpp.llama_bench(fake, tmp_path / "m.gguf", threads=1, gen=8, cache_type="f32")
    assert rec["avg_ts"] == 123.5


@pytest.mark.parametrize("figure", ["tg_d0", "pp512"])
def test_bitmtp_side_of_a_figure(figure, monkeypatch):
    import bitmtp
    from tests.support.hf_models import tiny_model

    model = bitmtp.load(tiny_model("llama", seed=1), capacity=600, quantize="ternary")
    tps = bitmtp_measure(model, figure)
    prompt, gen, depth = FIGURES[figure]
    assert tps > 0 and model.engine.n == (prompt if prompt else max(depth, 16) + gen)
    table = format_table([PeerRow(figure, "default", tps, tps / 2, 2.0, 0.37 if FIGURES[figure][1] else float("nan"))])
    assert figure in table and "2.00" in table and ("0.37" in table) == bool(FIGURES[figure][1])
