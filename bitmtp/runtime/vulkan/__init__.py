"""The Vulkan runtime (``bitmtp.load(..., runtime="vulkan")``, ``--runtime vulkan``): whole decoder layers
on a Vulkan device through WGSL shaders, with the layers that do not fit the VRAM budget on the CPU.

* :mod:`.device` — the device model (the decoder's layer spec executed with ``bitmtp.wgsl_fallback.ops``),
  the step pool and its runners (``runtime.protocols.StepPool`` / ``StepRunner``);
* :mod:`.planner` — the VRAM budget planner: which layers run on the device, which on the CPU.

The WGSL shaders and their Python dispatch layer (``bitmtp.wgsl_fallback``: ``runner.Runner``,
``ops.Ops``) are the kernels this runtime calls; they live beside the shaders (docs/ARCHITECTURE.md,
"The Vulkan runtime"). Importing this package needs neither wgpu nor a device (the planner is pure
Python; :mod:`.device` is imported when a pool is made).
"""
