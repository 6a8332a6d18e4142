"""The wgpu runner: one device, cached shader modules and pipelines, device tensors, batched dispatches.

Every op records a compute pass into the runner's open command encoder; nothing is submitted until a
host read (:meth:`Runner.read`) or an explicit :meth:`Runner.submit`, so a whole step is one
submission and one readback. Tensors are plain storage buffers with a shape and dtype
(:class:`DeviceTensor`); a tensor larger than one storage binding (``max_storage_buffer_binding_size``,
128 MiB on lavapipe — queried, never assumed) is held as row chunks that each fit one binding.

A step whose recording is the same every time (same pipelines, bind groups, grids, copies and uniform
contents) can be recorded once (:meth:`Runner.record`) and re-encoded from that :class:`Recording`
(:meth:`Runner.replay`) without running the Python that built it: WebGPU command buffers are single-use,
so this is the closest thing to a CUDA graph (``runtime/vulkan/device.py`` does it per replay state).

No Vulkan adapter → :class:`bitmtp.errors.BackendUnavailableError` naming the system packages that
provide one. ``WGPU_BACKEND_TYPE=Vulkan`` makes wgpu fail loudly instead of falling back to GL.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bitmtp.errors import BackendUnavailableError, BitMTPError, ShapeError

SHADER_DIR = Path(__file__).resolve().parent
VULKAN_HINT = ("no Vulkan adapter: install a Vulkan driver — on Debian/Ubuntu `apt-get install mesa-vulkan-drivers "
               "libvulkan1` (Mesa's lavapipe runs Vulkan on the CPU), or your GPU vendor's driver — and "
               "`pip install wgpu`")

_DTYPES = {"f32": np.float32, "i32": np.int32, "u32": np.uint32}


def _w2a8_rows_source(defines: frozenset[str]) -> str:
    from bitmtp.wgsl_fallback import w2a8_rows

    params = dict(d.split("=", 1) for d in defines)
    return w2a8_rows.source(int(params["TOKENS"]), int(params["WINDOWS"]), int(params["ROWS"]), params["ARITH"],
                            int(params.get("SHARE", 0)))


#: measures the subgroup size compute shaders run with: min and max of ``subgroup_size`` over a workgroup
#: of the rows W2A8 shader's size (64)
_SUBGROUP_PROBE = """
@group(0) @binding(0) var<storage, read_write> out: array<atomic<u32>, 2>;
@compute @workgroup_size(64)
fn main(@builtin(subgroup_size) sgs: u32) {
  atomicMin(&out[0], sgs);
  atomicMax(&out[1], sgs);
}
"""


def _dense_rows_source(defines: frozenset[str]) -> str:
    from bitmtp.wgsl_fallback import dense_rows

    params = dict(d.split("=", 1) for d in defines)
    return dense_rows.source(int(params["TOKENS"]), int(params["WINDOWS"]), params["KIND"], int(params["ROWS"]),
                             int(params["SHARE"]))


#: shaders whose WGSL is generated (name → generator of ``defines``) rather than read from a file
GENERATED = {"w2a8_rows": _w2a8_rows_source, "dense_rows": _dense_rows_source}


def _preload_triton() -> None:
    """Import Triton (when installed) before a Vulkan device exists. Triton's libtriton carries its own
    LLVM; loading it *after* Mesa's lavapipe has initialized its LLVM crashes the process (segfault seen
    here with triton 3.7 + Mesa 22.3: `Runner()` then `import triton`, which torch._dynamo and
    transformers do lazily). Loaded first, both coexist."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        try:
            import triton  # noqa: F401
        except Exception:  # a broken Triton must not stop the wgpu backend
            pass


class _OwnBackendChoice(logging.Filter):
    """Drops wgpu's "Forcing backend: Vulkan" warning when the forcing is this module's default, not the user's
    WGPU_BACKEND_TYPE (it read as a problem in every ``bitmtp info``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Forcing backend:")


def _wgpu():
    _preload_triton()
    own_choice = "WGPU_BACKEND_TYPE" not in os.environ
    os.environ.setdefault("WGPU_BACKEND_TYPE", "Vulkan")
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Mesa's WSI probe complains loudly without one
    try:
        import wgpu
    except ImportError as exc:
        raise BackendUnavailableError(f"wgpu backend: the wgpu package is not installed ({exc}); {VULKAN_HINT}") \
            from exc
    if own_choice:  # after the import: wgpu installs its own logger class for "wgpu" and checks it is the one
        logging.getLogger("wgpu").addFilter(_OwnBackendChoice())
    return wgpu


@dataclass
class DeviceTensor:
    """A tensor in device memory: ``chunks`` are storage buffers holding consecutive row ranges
    (``rows_per_chunk`` rows each, the last one possibly fewer); most tensors have one chunk."""

    shape: tuple[int, ...]
    dtype: str
    chunks: list[Any]
    rows_per_chunk: int
    runner: Runner = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 4

    @property
    def buffer(self) -> Any:
        if len(self.chunks) != 1:
            raise BitMTPError(f"tensor of shape {self.shape} is split in {len(self.chunks)} chunks; bind a chunk")
        return self.chunks[0]

    def numpy(self) -> np.ndarray:
        """Copy back to the host (submits pending work first)."""
        return self.runner.read(self)


class Runner:
    """One wgpu device and everything cached on it."""

    def __init__(self, *, max_binding_bytes: int | None = None):
        wgpu = _wgpu()
        self.wgpu = wgpu
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        except Exception as exc:  # wgpu raises RuntimeError/GPUError variants when no driver is found
            raise BackendUnavailableError(f"wgpu backend: {VULKAN_HINT} ({type(exc).__name__}: {exc})") from exc
        if adapter is None:
            raise BackendUnavailableError(f"wgpu backend: {VULKAN_HINT}")
        self.adapter = adapter
        self.info = dict(adapter.info)
        features = [f for f in ("subgroup",) if f in adapter.features]
        limits = {k: adapter.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                                 "max-storage-buffers-per-shader-stage",
                                                 "max-compute-workgroup-storage-size")}
        self.device = adapter.request_device_sync(required_features=features, required_limits=limits)
        self.features = set(features)
        device_limit = int(self.device.limits["max-storage-buffer-binding-size"])
        self.max_binding_bytes = min(device_limit, max_binding_bytes or device_limit)
        self.max_workgroups = int(self.device.limits["max-compute-workgroups-per-dimension"])
        self._modules: dict[tuple[str, frozenset[str]], Any] = {}
        self._pipelines: dict[tuple[str, str, frozenset[str]], Any] = {}
        self._encoder = None
        self._pass = None
        self._arenas: dict[Any, _Arena] = {}
        self._arena: _Arena | None = None
        self._subgroup_size: int | None = None
        self._recording: Recording | None = None
        #: dispatches recorded and host reads done (tests count them)
        self.dispatches = 0
        self.reads = 0
        #: why the subgroup size is unknown (the probe failed), or None
        self.subgroup_probe_error: str | None = None
        if "subgroup" in self.features:
            try:  # now, so that no step's recording is interrupted by its read
                self._probe_subgroup_size()
            except Exception as exc:  # a driver that offers the feature but fails the probe: per-lane loads
                self._subgroup_size, self.subgroup_probe_error = 0, f"{type(exc).__name__}: {exc}"

    # ---- shaders and pipelines -------------------------------------------------------------------------

    @property
    def subgroups(self) -> bool:
        """Whether shaders use subgroup reductions (the adapter offers the ``subgroup`` feature and
        ``BITMTP_WGPU_SUBGROUPS`` is not ``0``)."""
        return "subgroup" in self.features and os.environ.get("BITMTP_WGPU_SUBGROUPS", "1") != "0"

    @property
    def subgroup_size(self) -> int:
        """The subgroup size compute shaders run with on this device (lavapipe: the SIMD width in 32-bit
        lanes, 8 on AVX2 hosts), measured once by a probe dispatch when the device is created; 0 without
        subgroups (or with ``BITMTP_WGPU_SUBGROUPS=0``), or when invocations of one workgroup saw
        different sizes."""
        return (self._subgroup_size or 0) if self.subgroups else 0

    def _probe_subgroup_size(self) -> None:
        u = self.wgpu.BufferUsage
        buf = self.device.create_buffer(size=8, usage=u.STORAGE | u.COPY_SRC | u.COPY_DST)
        self.device.queue.write_buffer(buf, 0, np.array([0xFFFFFFFF, 0], np.uint32).tobytes())
        module = self.device.create_shader_module(code=_SUBGROUP_PROBE, label="subgroup_probe")
        pipe = self.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"},
                                                   label="subgroup_probe.main")
        group = self.device.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                              entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0,
                                                                                   "size": 8}}])
        enc = self.device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(pipe)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(1, 1, 1)
        cpass.end()
        self.device.queue.submit([enc.finish()])
        lo, hi = (int(v) for v in np.frombuffer(self.device.queue.read_buffer(buf, 0, 8), np.uint32))
        self._subgroup_size = lo if lo == hi else 0

    def _kernel_choice(self, variable: str) -> str:
        """``"rows"`` on an adapter of type CPU, ``"tiled"`` on GPUs, unless ``variable`` says
        ``rows`` or ``tiled`` (anything else is refused)."""
        choice = os.environ.get(variable, "").strip().lower()
        if choice in ("rows", "tiled"):
            return choice
        if choice:
            raise BitMTPError(f"{variable}: expected 'rows' or 'tiled', got {choice!r}")
        return "rows" if str(self.info.get("adapter_type", "")).upper() == "CPU" else "tiled"

    @property
    def w2a8_kernel(self) -> str:
        """Which W2A8 shader the ops use: ``"rows"`` (``w2a8_rows.py``: a row per invocation, activations
        from uniform-buffer windows — for CPU Vulkan drivers, where it measured 7–15× faster) or
        ``"tiled"`` (``w2a8.wgsl``: a workgroup per row, lanes over K — the GPU design). Default: rows on
        an adapter of type CPU, tiled on GPUs; ``BITMTP_WGPU_W2A8=rows|tiled`` overrides."""
        return self._kernel_choice("BITMTP_WGPU_W2A8")

    @property
    def dense_kernel(self) -> str:
        """Which dense shader the ops use: ``"rows"`` (``dense_rows.py``: rows per invocation, activations
        from uniform-buffer windows, vec4 weight loads — for CPU Vulkan drivers) or ``"tiled"``
        (``dense.wgsl``: lanes over K, a workgroup reduction — the GPU design). Default: rows on an
        adapter of type CPU, tiled on GPUs; ``BITMTP_WGPU_DENSE=rows|tiled`` overrides."""
        return self._kernel_choice("BITMTP_WGPU_DENSE")

    def source(self, shader: str, defines: frozenset[str] = frozenset()) -> str:
        """A shader's WGSL after the small preprocessor: ``//#if NAME`` / ``//#else`` / ``//#endif``
        blocks keep what ``defines`` (plus ``SUBGROUP`` when :attr:`subgroups`) select, and the
        ``/*SG_BUILTINS*/`` / ``/*SG_ARGS*/`` placeholders follow :attr:`subgroups`. A shader in
        :data:`GENERATED` is produced by its generator from ``defines`` instead."""
        if shader in GENERATED:
            return GENERATED[shader](defines)
        sg = self.subgroups
        names = set(defines) | ({"SUBGROUP"} if sg else set())
        out, keep = [], [True]
        for line in (SHADER_DIR / f"{shader}.wgsl").read_text().splitlines():
            tag = line.strip()
            if tag.startswith("//#if "):
                keep.append(keep[-1] and tag[len("//#if "):].strip() in names)
            elif tag == "//#else":
                keep[-1] = keep[-2] and not keep[-1]
            elif tag == "//#endif":
                keep.pop()
            elif keep[-1]:
                out.append(line)
        code = "\n".join(out)
        builtins = (", @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) sgs: u32" if sg else "")
        return code.replace("/*SG_BUILTINS*/", builtins).replace("/*SG_ARGS*/", "lane, sgs" if sg else "0u, 1u")

    def pipeline(self, shader: str, entry: str, defines: frozenset[str] = frozenset(),
                 constants: tuple[tuple[str, int], ...] = ()) -> Any:
        """The compute pipeline of ``shader.entry`` (cached) with preprocessor ``defines`` and WGSL
        ``override`` ``constants`` (e.g. the token width a kernel is specialized for)."""
        key = (shader, entry, defines, constants)
        if key not in self._pipelines:
            mkey = (shader, defines)
            if mkey not in self._modules:
                self._modules[mkey] = self.device.create_shader_module(code=self.source(shader, defines),
                                                                       label=shader)
            stage = {"module": self._modules[mkey], "entry_point": entry}
            if constants:
                stage["constants"] = dict(constants)
            self._pipelines[key] = self.device.create_compute_pipeline(layout="auto", compute=stage,
                                                                       label=f"{shader}.{entry}")
        return self._pipelines[key]

    # ---- tensors ---------------------------------------------------------------------------------------

    def _usage(self):
        u = self.wgpu.BufferUsage
        # UNIFORM too: the rows W2A8 shader binds activation windows of a storage tensor as uniforms
        return u.STORAGE | u.UNIFORM | u.COPY_SRC | u.COPY_DST

    @contextmanager
    def arena(self, key: Any, user: Any = None) -> Iterator[bool]:
        """Within this block, :meth:`empty`, :meth:`uniform` and bind groups come from ``key``'s arena and
        are reused by the next block with the same key (a replay state records the same allocations every
        step). Re-entering an arena whose work is not submitted yet submits first: its uniforms are about
        to be rewritten, and queue writes land before the commands of the next submission. Yields whether
        ``user`` was also the arena's previous user: a recording made in it is only replayable while no
        other user (another model's runner of the same state) has rewritten its uniforms since."""
        arena = self._arenas.setdefault(key, _Arena())
        same_user = user is not None and arena.user is user
        arena.user = user
        if arena.pending:
            self.submit()
        arena.i_buf = arena.i_uni = 0
        outer, self._arena = self._arena, arena
        arena.pending = True
        try:
            yield same_user
        finally:
            self._arena = outer

    def empty(self, shape: tuple[int, ...], dtype: str = "f32", *, chunk_rows: int | None = None,
              min_bytes: int = 0) -> DeviceTensor:
        """An uninitialized device tensor (zero-filled by wgpu), split by rows if it exceeds one binding;
        inside :meth:`arena`, the arena's slot for this request. ``min_bytes``: allocate at least this
        many bytes (a one-chunk tensor whose buffer is bound in fixed-size windows past its end)."""
        shape = tuple(int(s) for s in shape)
        a = self._arena
        if a is not None and chunk_rows is None:
            i = a.i_buf
            a.i_buf += 1
            old = a.buffers[i] if i < len(a.buffers) else None
            if old is not None and old[:2] == (shape, dtype) and old[2].chunks[0].size >= min_bytes:
                return old[2]
            t = self._new_tensor(shape, dtype, None, min_bytes)
            if i < len(a.buffers):
                a.buffers[i] = (shape, dtype, t)
            else:
                a.buffers.append((shape, dtype, t))
            return t
        return self._new_tensor(shape, dtype, chunk_rows, min_bytes)

    def _new_tensor(self, shape: tuple[int, ...], dtype: str, chunk_rows: int | None,
                    min_bytes: int = 0) -> DeviceTensor:
        if dtype not in _DTYPES:
            raise BitMTPError(f"dtype: expected one of {list(_DTYPES)}, got {dtype!r}")
        if not shape or min(shape) <= 0:
            raise ShapeError(f"shape: expected non-empty dimensions, got {shape}")
        rows = shape[0]
        row_bytes = int(np.prod(shape[1:])) * 4 if len(shape) > 1 else 4
        if row_bytes > self.max_binding_bytes:
            raise ShapeError(f"tensor of shape {shape}: one row ({row_bytes} bytes) exceeds the device's storage "
                             f"binding limit of {self.max_binding_bytes} bytes and cannot be split by rows")
        per = chunk_rows or max(1, self.max_binding_bytes // row_bytes)
        per = min(per, rows)
        if min_bytes and per < rows:
            raise ShapeError(f"tensor of shape {shape}: min_bytes needs a one-chunk tensor")
        chunks = []
        for start in range(0, rows, per):
            n = min(per, rows - start)
            size = max(16, n * row_bytes, min_bytes)
            chunks.append(self.device.create_buffer(size=-(-size // 4) * 4, usage=self._usage()))
        return DeviceTensor(shape, dtype, chunks, per, self)

    def upload(self, array: np.ndarray, dtype: str | None = None, *, chunk_rows: int | None = None) -> DeviceTensor:
        """A device copy of ``array`` (f32 / i32 / u32; other dtypes are converted to ``dtype``)."""
        arr = np.asarray(array)
        if dtype is None:
            dtype = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32", np.dtype(np.uint32): "u32"}.get(arr.dtype)
            if dtype is None:
                raise BitMTPError(f"upload: dtype {arr.dtype} needs an explicit dtype= (f32, i32 or u32)")
        arr = np.ascontiguousarray(arr, dtype=_DTYPES[dtype])
        if arr.ndim == 0:
            arr = arr.reshape(1)
        t = self.empty(arr.shape, dtype, chunk_rows=chunk_rows)
        self.write(t, arr)
        return t

    def write(self, t: DeviceTensor, array: np.ndarray) -> None:
        """Overwrite ``t`` with ``array`` (same number of elements). Queue writes land before the next
        submission's commands, so pending commands (which may read ``t``) are submitted first."""
        if self._recording is not None:
            self._recording.host_work = True
        if self._encoder is not None:
            self.submit()
        arr = np.ascontiguousarray(array, dtype=_DTYPES[t.dtype]).reshape(t.shape)
        for i, buf in enumerate(t.chunks):
            part = arr[i * t.rows_per_chunk:(i + 1) * t.rows_per_chunk]
            self.device.queue.write_buffer(buf, 0, part.tobytes())

    def read(self, t: DeviceTensor) -> np.ndarray:
        """Submit pending work and copy ``t`` back to the host (one read per chunk)."""
        if self._recording is not None:
            self._recording.host_work = True
        self.submit()
        self.reads += 1
        parts = []
        rows = t.shape[0]
        row_elems = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        for i, buf in enumerate(t.chunks):
            n = min(t.rows_per_chunk, rows - i * t.rows_per_chunk)
            raw = self.device.queue.read_buffer(buf, 0, n * row_elems * 4)
            parts.append(np.frombuffer(raw, dtype=_DTYPES[t.dtype]).copy())
        return np.concatenate(parts).reshape(t.shape)

    def uniform(self, fmt: str, *values: Any) -> Any:
        """A uniform buffer holding ``struct.pack(fmt, *values)`` (an arena slot, rewritten only when the
        values change, inside :meth:`arena`)."""
        data = struct.pack(fmt, *values)
        data += b"\0" * (-len(data) % 16)
        if self._recording is not None:
            self._recording.uniforms.append(data)
        a = self._arena
        if a is not None:
            i = a.i_uni
            a.i_uni += 1
            if i < len(a.uniforms) and a.uniforms[i][0].size == len(data):
                buf, old = a.uniforms[i]
                if old != data:
                    self.device.queue.write_buffer(buf, 0, data)
                    a.uniforms[i] = (buf, data)
                return buf
        u = self.wgpu.BufferUsage
        buf = self.device.create_buffer(size=len(data), usage=u.UNIFORM | u.COPY_DST)
        self.device.queue.write_buffer(buf, 0, data)
        if a is not None:
            if i < len(a.uniforms):
                a.uniforms[i] = (buf, data)
            else:
                a.uniforms.append((buf, data))
        return buf

    # ---- dispatch --------------------------------------------------------------------------------------

    def dispatch(self, shader: str, entry: str, bindings: dict[int, Any], groups: tuple[int, int, int],
                 defines: frozenset[str] = frozenset(), constants: tuple[tuple[str, int], ...] = ()) -> None:
        """Record one compute dispatch; ``bindings`` maps binding index → buffer (uniform or storage), or
        to ``(buffer, offset, size)`` to bind a byte range of it."""
        pipeline = self.pipeline(shader, entry, defines, constants)

        def _range(b):
            buf, off, size = b if isinstance(b, tuple) else (b, 0, None)
            buf = buf.buffer if isinstance(buf, DeviceTensor) else buf
            return buf, off, buf.size - off if size is None else size

        bufs = [(i, *_range(b)) for i, b in sorted(bindings.items())]
        a = self._arena
        key = (shader, entry, defines, constants, tuple(bufs)) if a is not None else None  # keeps buffers alive
        group = a.groups.get(key) if a is not None else None
        if group is None:
            entries = [{"binding": i, "resource": {"buffer": b, "offset": off, "size": size}}
                       for i, b, off, size in bufs]
            group = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
            if a is not None:
                a.groups[key] = group
        if self._recording is not None:
            self._recording.commands.append((pipeline, group, tuple(groups)))
        self._encode(pipeline, group, groups)

    def _encode(self, pipeline: Any, group: Any, groups: tuple[int, int, int]) -> None:
        if self._pass is None:  # consecutive dispatches share one compute pass (ordered, writes visible)
            if self._encoder is None:
                self._encoder = self.device.create_command_encoder()
            self._pass = self._encoder.begin_compute_pass()
        self._pass.set_pipeline(pipeline)
        self._pass.set_bind_group(0, group)
        self._pass.dispatch_workgroups(*groups)
        self.dispatches += 1

    @contextmanager
    def record(self) -> Iterator[Recording]:
        """Record what the block encodes (it is encoded as usual too) into a :class:`Recording`; a
        recording that wrote or read host memory (``host_work``) cannot be replayed."""
        if self._recording is not None:
            raise BitMTPError("Runner.record: already recording (recordings do not nest)")
        rec = self._recording = Recording()
        try:
            yield rec
        finally:
            self._recording = None

    def replay(self, rec: Recording) -> None:
        """Encode ``rec``'s dispatches and copies again, in order, with the same pipelines and bind groups
        (so the same buffers, and uniforms that still hold what they held when it was recorded)."""
        if rec.host_work:
            raise BitMTPError("Runner.replay: this recording wrote or read host memory; run its code instead")
        if self._recording is not None:  # a replay inside a recording is part of it
            self._recording.commands += rec.commands
            self._recording.uniforms += rec.uniforms
        for cmd in rec.commands:
            if len(cmd) == 3:
                self._encode(*cmd)
            else:
                self._encode_copy(*cmd)

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None:
        """Record a buffer-to-buffer copy (byte offsets and size multiples of 4)."""
        if self._recording is not None:
            self._recording.commands.append((src, src_offset, dst, dst_offset, nbytes))
        self._encode_copy(src, src_offset, dst, dst_offset, nbytes)

    def _encode_copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None:
        self._end_pass()  # copies are recorded outside compute passes
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        self._encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)

    def grid(self, n: int) -> tuple[int, int, int]:
        """Workgroup counts for ``n`` workgroups (2-D when n exceeds the per-dimension limit)."""
        if n <= self.max_workgroups:
            return (n, 1, 1)
        return (self.max_workgroups, -(-n // self.max_workgroups), 1)

    def submit(self) -> None:
        self._end_pass()
        if self._encoder is not None:
            self.device.queue.submit([self._encoder.finish()])
            self._encoder = None
        for arena in self._arenas.values():
            arena.pending = False

    def sync(self) -> None:
        """Submit and wait for the device to finish (for timing): mapping a 4-byte buffer waits for every
        submitted command (``on_submitted_work_done_sync`` is broken in wgpu 0.32's ctypes)."""
        self.submit()
        if getattr(self, "_fence", None) is None:
            self._fence = self.device.create_buffer(size=16, usage=self._usage())
        self.device.queue.read_buffer(self._fence, 0, 4)


class Recording:
    """The commands one block encoded (:meth:`Runner.record`): dispatches ``(pipeline, bind group,
    grid)`` and copies ``(src, src offset, dst, dst offset, bytes)``, in order, plus the contents of the
    uniforms it asked for (two recordings with the same commands but other uniform values differ)."""

    def __init__(self) -> None:
        self.commands: list[tuple] = []
        self.uniforms: list[bytes] = []
        self.host_work = False  # wrote or read host memory: not replayable

    def same_as(self, other: Recording) -> bool:
        """Whether both encode the same thing: the same pipeline, bind group and buffer objects, grids,
        offsets and uniform contents, in the same order."""
        if self.host_work or other.host_work or len(self.commands) != len(other.commands):
            return False
        if self.uniforms != other.uniforms:
            return False
        return all(len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
                   for a, b in zip(self.commands, other.commands, strict=True))


def _same(x: Any, y: Any) -> bool:
    """Command fields: the same object (pipeline, bind group, buffer), or equal grids and offsets."""
    return x is y or (isinstance(x, (int, tuple)) and x == y)


class _Arena:
    """Buffers, uniforms and bind groups of one replay state, reused step after step: a state records
    the same sequence of allocations every time, so the i-th request gets the i-th slot."""

    def __init__(self) -> None:
        self.buffers: list[tuple[tuple[int, ...], str, DeviceTensor]] = []
        self.uniforms: list[tuple[Any, bytes]] = []
        self.groups: dict[tuple, Any] = {}
        self.i_buf = self.i_uni = 0
        self.pending = False  # recorded into the open (unsubmitted) encoder
        self.user: Any = None  # who entered it last (Runner.arena)


_DEFAULT: Runner | None = None


def default_runner() -> Runner:
    """The process-wide runner (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Runner()
    return _DEFAULT


def availability() -> tuple[bool, str]:
    """``(ok, reason)``: can a wgpu Vulkan adapter be opened here?"""
    try:
        r = default_runner()
    except BitMTPError as exc:
        return False, str(exc)
    sg = f", subgroups of {r.subgroup_size}" if r.subgroup_size else ""
    try:
        kernels = f"W2A8 / dense shaders: {r.w2a8_kernel} / {r.dense_kernel}"
    except BitMTPError as exc:  # a bad BITMTP_WGPU_W2A8 / _DENSE: the device is there, the choice is not
        kernels = f"no shader choice ({exc})"
    return True, f"{r.info.get('device', '?')} ({r.info.get('backend_type', '?')}{sg}; {kernels})"


__all__ = ["Runner", "Recording", "DeviceTensor", "default_runner", "availability", "VULKAN_HINT"]
