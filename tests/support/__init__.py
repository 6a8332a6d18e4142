"""Helpers shared by more than one test module (issue 22: no test module imports another one).

Fixtures stay in the ``conftest.py`` files; what a test imports by name lives here, one module per
subject: ``hf_models`` (tiny transformers models), ``adapters`` (random MTP adapters), ``smollm2``
(the real model and its prompts), ``random_inputs``, ``w2a8``, ``cpu_native``, ``logits``,
``model_files``, ``convert``, ``tokenizers``, ``training``, ``wgpu_device``, ``wgsl`` and ``paths``.
"""
