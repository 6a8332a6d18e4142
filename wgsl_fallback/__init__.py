"""WGSL shaders and their wgpu runner, installed as ``bitmtp.wgsl_fallback``.

``runner.Runner`` owns one wgpu device (Vulkan; lavapipe on machines without a GPU), cached pipelines
and device tensors; ``ops.Ops`` records the decoder's ops as dispatches: W2A8 linear with 16-token
register tiling (``w2a8.wgsl``), activation quantization, dense linear, RMSNorm, RoPE, KV write,
masked attention, residual add, SiLU-gate / relu², argmax with its probability and embedding gather.
Importing this package needs neither wgpu nor a device; creating a ``Runner`` does.

This is the kernels layer of the Vulkan runtime (``bitmtp.runtime.vulkan``, which executes a model's
layer spec with these ops): shaders and their Python dispatch stay together here, importing only
wgpu, numpy and ``bitmtp.errors``. Tests: ``tests/wgsl_fallback/test_<shader>.py``.
"""
