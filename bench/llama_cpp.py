"""llama.cpp's ``llama-bench`` as the peer of the CPU benchmarks (issue "CPU runtime ahead of llama.cpp").

Built once from the llama-cpp-python sdist (its vendored llama.cpp; the registry is the only network
these machines reach) into a cache folder, then run on the same GGUF as bitmtp:

* ``ensure_llama_bench()`` — download the sdist (``pip download --no-binary :all: --no-deps``), configure
  with ``GGML_NATIVE=OFF`` and explicit ISA options taken from this CPU's flags (a native build died with
  an illegal instruction on one of these machines: the compiler's idea of "native" and the VM's CPUID
  disagreed), build the ``llama-bench`` target only, statically linked. The binary is cached under
  ``$BITMTP_PEER_DIR`` (default ``~/.cache/bitmtp/peers``) keyed by the sdist version, the ISA options and
  the compiler, so a new machine kind builds its own. Raises :class:`PeerUnavailable` with the reason
  (no compiler, no cmake, no registry, a failed build — its log's tail) so callers skip clearly.
* ``llama_bench(...)`` — one run of the binary with ``-o json``; returns its records (``avg_ts`` is
  tokens/s, ``n_prompt`` / ``n_gen`` / ``n_depth`` say what was measured).

The build takes ~6 min on 2 cores. ``python scripts/peer_bench.py`` runs the comparison for users.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: the sdist whose vendored llama.cpp is the peer (pinned: a figure means one llama.cpp)
SDIST_NAME, SDIST_VERSION = "llama-cpp-python", "0.3.36"


class PeerUnavailable(RuntimeError):
    """llama-bench cannot be built or run here; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("BITMTP_PEER_DIR") or Path.home() / ".cache" / "bitmtp" / "peers")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_options(flags: set[str] | None = None) -> dict[str, str]:
    """cmake ``-D`` options for the x86 ISA extensions this CPU lists (GGML_NATIVE off)."""
    f = cpu_flags() if flags is None else flags
    on = lambda cond: "ON" if cond else "OFF"  # noqa: E731
    opts = {"GGML_NATIVE": "OFF"}
    if platform.machine() in ("x86_64", "AMD64"):
        opts.update({
            "GGML_SSE42": on("sse4_2" in f), "GGML_AVX": on("avx" in f), "GGML_AVX2": on("avx2" in f),
            "GGML_FMA": on("fma" in f), "GGML_F16C": on("f16c" in f), "GGML_BMI2": on("bmi2" in f),
            "GGML_AVX_VNNI": on("avx_vnni" in f),
            "GGML_AVX512": on({"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= f),
            "GGML_AVX512_VBMI": on("avx512vbmi" in f), "GGML_AVX512_VNNI": on("avx512_vnni" in f),
            "GGML_AVX512_BF16": on("avx512_bf16" in f),
            # AMX is listed on some of these VMs without the kernel enabling it: never build it in
            "GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF", "GGML_AMX_BF16": "OFF",
        })
    return opts


def _compiler() -> str:
    cc = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if not cc:
        raise PeerUnavailable("no C++ compiler (install g++ to build llama.cpp's llama-bench)")
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        raise PeerUnavailable(f"the C++ compiler {cc} does not run: {exc}") from exc


def build_key(options: dict[str, str], compiler: str) -> str:
    blob = json.dumps({"sdist": SDIST_VERSION, "options": options, "compiler": compiler}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: the llama.cpp programs these benchmarks build: llama-bench (kernels, prefill, decode) and llama-server
#: (the serving peer of ``bitmtp serve``, bench/e2e/test_bench_threads.py)
TOOLS = ("llama-bench", "llama-server")


def binary_path(options: dict[str, str] | None = None, tool: str = "llama-bench") -> Path:
    opts = isa_options() if options is None else options
    return cache_root() / f"{tool}-{SDIST_VERSION}-{build_key(opts, _compiler())}" / tool


def ensure_llama_bench(*, jobs: int | None = None, log=None) -> Path:
    """The cached ``llama-bench`` binary, built first if needed (see the module docstring)."""
    return ensure_llama_tool("llama-bench", jobs=jobs, log=log)


def ensure_llama_server(*, jobs: int | None = None, log=None) -> Path:
    """The cached ``llama-server`` binary (llama.cpp's OpenAI-compatible server), built first if needed."""
    return ensure_llama_tool("llama-server", jobs=jobs, log=log)


def ensure_llama_tool(tool: str, *, jobs: int | None = None, log=None) -> Path:
    """The cached binary of llama.cpp program ``tool`` (one of :data:`TOOLS`), built first if needed."""
    if tool not in TOOLS:
        raise ValueError(f"tool: one of {TOOLS}, got {tool!r}")
    say = log or (lambda msg: print(msg, file=sys.stderr))
    opts = isa_options()
    target = binary_path(opts, tool)
    if target.is_file() and os.access(target, os.X_OK):
        return target
    if not shutil.which("cmake"):
        raise PeerUnavailable("cmake is not installed (pip install cmake, or apt-get install cmake)")
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent.parent) as tmp:
        work = Path(tmp)
        say(f"{tool}: downloading the {SDIST_NAME} {SDIST_VERSION} sdist")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                              f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(work)],
                             capture_output=True, text=True, timeout=900)
        archives = list(work.glob("*.tar.gz"))
        if got.returncode or not archives:
            raise PeerUnavailable(f"pip download {SDIST_NAME}=={SDIST_VERSION} failed: {got.stderr.strip()[-400:]}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if src is None:
            raise PeerUnavailable("the sdist has no vendor/llama.cpp folder")
        build = work / "build"
        cfg = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               f"-DLLAMA_BUILD_SERVER={'ON' if tool == 'llama-server' else 'OFF'}", "-DLLAMA_BUILD_TOOLS=ON"] + \
            [f"-D{k}={v}" for k, v in opts.items()]
        say(f"{tool}: " + " ".join(cfg[5:]))
        make = ["cmake", "--build", str(build), "--target", tool, "-j", str(jobs or os.cpu_count() or 1)]
        for cmd in (cfg, make):
            step = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if step.returncode:
                tail = (step.stdout + step.stderr).strip()[-1500:]
                raise PeerUnavailable(f"building {tool} failed ({' '.join(cmd[:3])}):\n{tail}")
        built = next(build.glob(f"**/bin/{tool}"), None)
        if built is None:
            raise PeerUnavailable(f"the build finished without a {tool} binary")
        staged = target.parent.with_name(target.parent.name + ".partial")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        shutil.copy2(built, staged / tool)
        (staged / "build.json").write_text(json.dumps({"sdist": SDIST_VERSION, "options": opts,
                                                       "compiler": _compiler()}, indent=1))
        shutil.rmtree(target.parent, ignore_errors=True)
        staged.rename(target.parent)  # atomic: a half-copied binary is never found
    say(f"{tool}: built {target}")
    return target


def llama_bench(binary: Path, model: Path, *, threads: int, prompt: int = 0, gen: int = 0, depth: int = 0,
                reps: int = 3, batch: int | None = None, ubatch: int | None = None, cache_type: str | None = None,
                timeout: float = 1800) -> dict:
    """One llama-bench measurement (``-p prompt`` or ``-n gen`` at ``-d depth``; ``cache_type``: the KV
    cache's type, e.g. ``f32``, else llama.cpp's default f16); returns its JSON record (``avg_ts``:
    tokens/s)."""
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
           "-r", str(reps), "-o", "json"]
    if batch:
        cmd += ["-b", str(batch)]
    if ubatch:
        cmd += ["-ub", str(ubatch)]
    if cache_type:
        cmd += ["-ctk", cache_type, "-ctv", cache_type]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise PeerUnavailable(f"llama-bench failed (rc {out.returncode}): {out.stderr.strip()[-600:]}")
    records = json.loads(out.stdout)
    if not records:
        raise PeerUnavailable("llama-bench printed no result")
    return records[0]
