"""Backend implementations, registered lazily with :mod:`bitmtp.ops.registry`."""

from bitmtp.ops.registry import register_backend


def _torch():
    from bitmtp.ops.backends.torch_backend import TorchBackend

    return TorchBackend()


def _triton():
    from bitmtp.ops.backends.triton_backend import TritonBackend

    return TritonBackend()


register_backend("torch", _torch)
register_backend("triton", _triton)


def _cpu():
    from bitmtp.ops.backends.cpu_backend import CpuBackend

    return CpuBackend()


def _cuda():
    from bitmtp.ops.backends.cuda_backend import CudaBackend

    return CudaBackend()


register_backend("cpu", _cpu)
register_backend("cuda", _cuda)
