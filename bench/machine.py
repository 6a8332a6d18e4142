"""Machine kind: the key under which benchmark baselines are stored (``bench/baselines/<kind>.json``).

Ratios (kernel time over copy time, hybrid over AR tokens/s, …) are stable across machines of one
kind and differ between kinds, so a baseline holds for every machine whose kind matches. The kind is

    <arch>-<cpu model>-<logical cores>c[-<cpu isa>][-<gpu name>]

lower-cased, every run of characters other than ``[a-z0-9]`` folded to one ``-``; for example
``x86_64-amd-epyc-2c-avx512vnni`` or ``x86_64-intel-xeon-platinum-8480-32c-avx512vnni-nvidia-h200``.
The CPU model is the first ``model name`` of ``/proc/cpuinfo`` (``platform.processor()`` elsewhere);
the CPU ISA is the best path of the native CPU kernels the flags allow (``avx512vnni``, ``avx2``, or
nothing: scalar), because one VM model name can come with or without AVX-512 and the kernel ratios
differ by path (this project's 2-vCPU "AMD EPYC" hosts have shown both); the GPU is CUDA device 0
when torch sees one. ``BITMTP_MACHINE_KIND`` overrides the whole string (a CI fleet whose hosts
report different model names but are one kind, say).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

ENV_VAR = "BITMTP_MACHINE_KIND"


def slug(text: str) -> str:
    """``text`` lower-cased with every run of characters outside ``[a-z0-9_]`` folded to one ``-``."""
    return re.sub(r"[^a-z0-9_]+", "-", text.lower()).strip("-") or "unknown"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


# CPUID flags (as /proc/cpuinfo spells them) each native kernel path needs (csrc/cpu/linear_run.cpp)
ISA_FLAGS = {"avx512vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c"),
             "avx2": ("avx2", "fma", "f16c")}


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The best native CPU kernel path this CPU's flags allow (``avx512vnni``, ``avx2``), else None."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            break
    for name, need in ISA_FLAGS.items():
        if all(f in flags for f in need):
            return name
    return None


#: What the weight-streaming benchmarks assume when sysfs does not say (this project's AMD hosts: 32 MiB).
DEFAULT_LLC_BYTES = 32 * 2**20
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.IGNORECASE)


def last_level_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of CPU 0's last-level data (or unified) cache from sysfs, or None where it is not listed.

    Read per machine, not assumed: this project's hosts range from a 32 MiB L3 (AMD EPYC VMs) to a
    480 MiB one (an Intel Xeon VM), where a 70 MB float32 matrix stays in cache between calls."""
    best: tuple[int, int] | None = None
    try:
        entries = sorted(cache_dir.glob("index*"))
    except OSError:
        return None
    for entry in entries:
        try:
            level = int((entry / "level").read_text().strip())
            kind = (entry / "type").read_text().strip()
            match = _SIZE.match((entry / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not match:
            continue
        size = int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2).upper()]
        if best is None or level > best[0] or (level == best[0] and size > best[1]):
            best = (level, size)
    return best[1] if best else None


def streaming_bytes(minimum: int = 128 * 2**20, cap: int = 2 * 2**30, llc: int | None | bool = True) -> int:
    """How many bytes a benchmark's rotating weight copies must total so each call reads its weights from
    memory, as a decode step over a model larger than the cache does: twice the last-level cache, at least
    ``minimum`` (128 MiB, 4x a 32 MiB L3), at most ``cap`` (a bound on the benchmark's memory).
    ``llc``: the cache size to assume (None: :data:`DEFAULT_LLC_BYTES`); True reads it from sysfs."""
    size = last_level_cache_bytes() if llc is True else llc
    return min(cap, max(minimum, 2 * (size or DEFAULT_LLC_BYTES)))


def rotating_copies(base, total_bytes: int, minimum: int = 1) -> list:
    """``base`` and clones of it, together at least ``total_bytes`` (and ``minimum`` tensors): weights a
    benchmark cycles through so that each call reads its copy from memory (size ``total_bytes`` with
    :func:`streaming_bytes`)."""
    count = max(minimum, -(-total_bytes // (base.numel() * base.element_size())))
    return [base] + [base.clone() for _ in range(count - 1)]


def gpu_name() -> str | None:
    """CUDA device 0's name, or None without a visible GPU (or without torch)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def machine_kind(*, arch: str | None = None, cpu: str | None = None, cores: int | None = None,
                 isa: str | None | bool = True, gpu: str | None | bool = True) -> str:
    """This machine's kind (see the module docstring); the keyword arguments replace a detected part
    (``isa``/``gpu`` ``None`` or ``False``: no such part), so tests can build kinds of other machines."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env and arch is None and cpu is None and cores is None and isa is True and gpu is True:
        return slug(env)
    parts = [arch or platform.machine() or "unknown-arch", cpu or cpu_model(), f"{cores or os.cpu_count() or 1}c"]
    i = cpu_isa() if isa is True else (isa or None)
    if i:
        parts.append(i)
    g = gpu_name() if gpu is True else (gpu or None)
    if g:
        parts.append(g)
    return "-".join(slug(p) for p in parts)


if __name__ == "__main__":
    print(machine_kind())
