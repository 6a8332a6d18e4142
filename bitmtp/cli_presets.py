"""Model shapes the CLI knows by name, for ``python -m bitmtp info --plan --preset NAME``: plans of models
that need not be on this machine (no weights, no downloads). The CLI's data, read by ``bitmtp.cli``.

Each entry is a :class:`~bitmtp.model.args.ModelArgs` as its checkpoint's config would give it; the MLP
activation is the family's default (``bitmtp.model.families``), so no entry names one.
"""

from __future__ import annotations

from bitmtp.model.args import ModelArgs

#: preset name → model shape
PRESETS: dict[str, ModelArgs] = {
    "bitnet-b1.58-2b-4t": ModelArgs(  # microsoft/bitnet-b1.58-2B-4T
        family="bitnet", vocab_size=128256, hidden_size=2560, num_layers=30, num_heads=20, num_kv_heads=5,
        head_dim=128, intermediate_size=6912, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=4096, tie_word_embeddings=True),
    "llama3-8b-1.58": ModelArgs(  # HF1BitLLM/Llama3-8B-1.58-100B-tokens
        family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False),
    "smollm2-135m": ModelArgs(  # HuggingFaceTB/SmolLM2-135M
        family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
}

__all__ = ["PRESETS"]
