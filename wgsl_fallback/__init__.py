"""WGSL shaders and their wgpu runner, installed as ``bitmtp.wgsl_fallback``.

The shaders themselves are built by the Vulkan-fallback issue; until then this package holds no
kernels and the ``wgpu`` backend is not registered.
"""
