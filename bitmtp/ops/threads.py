"""Who runs torch's own CPU ops inside a step: the calling thread alone, while the extension keeps its team.

Why: torch (Linux builds: GNU OpenMP) runs a large CPU op — a softmax, sort or cumsum over a 49152-token
vocabulary — as an OpenMP region, and libgomp's workers then spin for milliseconds waiting for the next
one, on the same cores the extension's thread team (csrc/cpu/pool.h) needs for the next step's kernels.
Measured on a 2-vCPU Xeon, SmolLM2: sampled decoding (temperature 0.7) 118 tok/s with libgomp's workers
passive, 82 tok/s with them spinning. :func:`torch_ops_inline` sets the calling thread's OpenMP thread
count (an OpenMP per-thread setting: other threads, and torch's process-wide default, are untouched) to 1
for the block, so torch's ops there run inline, and records the thread count the extension's kernels use
meanwhile (:func:`kernel_threads`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from bitmtp.errors import BitMTPError
from bitmtp.ops import registry

log = logging.getLogger("bitmtp")

_local = threading.local()
_omp_lib: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _omp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's ATen parallel backend uses, found among the loaded libraries (None when
    torch does not use OpenMP or it cannot be found: the block then changes nothing)."""
    global _omp_lib
    if _omp_lib is False:
        _omp_lib = None
        try:
            if "parallel backend: OpenMP" in torch.__config__.parallel_info():
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
                for path in sorted(paths):
                    name = path.rsplit("/", 1)[-1]
                    if name.startswith(("libgomp", "libiomp5", "libomp")):
                        lib = ctypes.CDLL(path)
                        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                        lib.omp_get_max_threads.restype = ctypes.c_int
                        _omp_lib = lib
                        break
        except (OSError, AttributeError) as exc:  # no /proc, no such symbol: run as before
            log.debug("bitmtp: torch's OpenMP runtime not found (%s); its ops keep their threads", exc)
            _omp_lib = None
    return _omp_lib  # type: ignore[return-value]


def kernel_threads() -> int:
    """Threads the extension's kernels use from this thread: torch's intra-op count, or inside
    :func:`torch_ops_inline` the count it had before the block."""
    return getattr(_local, "threads", 0) or torch.get_num_threads()


class torch_ops_inline:  # noqa: N801 (used as a function: ``with torch_ops_inline():``)
    """Inside the block torch's CPU ops on this thread run without OpenMP regions (see the module's doc);
    the extension's kernels keep :func:`kernel_threads`. Nested blocks are free. (A class, not a
    ``@contextmanager`` generator: a step enters one, and the generator's machinery cost ~30-60 µs of it with the
    caches cold after the layers: bench/glue.py.)"""

    __slots__ = ("_before", "_omp")

    def __enter__(self) -> None:
        self._omp = None
        if getattr(_local, "threads", 0):
            return
        threads = torch.get_num_threads()  # also torch's lazy per-thread init, which would reset the count below
        omp = _omp() if threads > 1 else None
        if omp is None:
            return
        self._before = omp.omp_get_max_threads()
        _local.threads = threads
        omp.omp_set_num_threads(1)
        self._omp = omp

    def __exit__(self, *exc) -> None:
        if self._omp is not None:
            self._omp.omp_set_num_threads(self._before)
            _local.threads = 0


def step_threads(device: torch.device) -> AbstractContextManager[None]:
    """What a step on ``device`` runs in: :func:`torch_ops_inline` when its kernels run on the ``cpu``
    backend's thread team, else nothing (a step on the pure-torch path needs torch's threads)."""
    if device.type != "cpu":
        return nullcontext()
    try:
        impl = registry.select("attention", device)
    except BitMTPError:  # a pinned backend that cannot run here: the step itself will say so
        return nullcontext()
    if getattr(getattr(impl, "__self__", None), "name", None) != "cpu":
        return nullcontext()
    return torch_ops_inline()
