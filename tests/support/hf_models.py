"""Tiny random transformers models of the three families, saved in their real on-disk formats."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "bitnet")

#: ``tiny_model`` arguments per family whose greedy continuations of random prompts vary. With the
#: default initializer_range (0.02) the logits are nearly flat and the tiny qwen3 emits one token
#: forever, so a test comparing its greedy output proves little (a q_norm/k_norm swap passed).
#: Measured over 100 random prompts of 1..39 tokens, distinct tokens among the first 20 generated:
#: llama ≥ 13, bitnet ≥ 11, qwen3 ≥ 7 (median 11; its tied embeddings make short loops likelier).
VARIED = {"llama": dict(seed=3, initializer_range=0.3), "qwen3": dict(seed=1, initializer_range=0.4),
          "bitnet": dict(seed=6, initializer_range=0.4)}


def tiny_config(family: str, **over):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    common.update(over)
    if family == "llama":
        common.setdefault("tie_word_embeddings", False)
        return tf.LlamaConfig(**common)
    if family == "qwen3":
        common.setdefault("head_dim", 16)
        common.setdefault("tie_word_embeddings", True)
        return tf.Qwen3Config(**common)
    if family == "bitnet":
        return tf.BitNetConfig(**common)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **over):
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "bitnet": tf.BitNetForCausalLM}[family]
    model = cls(tiny_config(family, **over)).eval()
    with torch.no_grad():  # random norms too, so a wrong norm placement shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def save_bitnet_packed(model, path: Path) -> Path:
    """Write ``model`` (a float BitNetForCausalLM) as a ternary BitNet checkpoint in transformers' packed
    format: uint8 [N/4, K] weights + weight_scale (= 1 / absmean, the BitLinear convention) and a
    ``quantization_config`` that transformers' BitNet quantizer reads."""
    import json

    from safetensors.torch import save_file

    from bitmtp.formats import absmean_ternarize, pack_bitnet

    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("_proj.weight") and ".layers." in name:
            q, a = absmean_ternarize(t.float(), "tensor")
            tensors[name] = pack_bitnet(q)
            tensors[name.replace(".weight", ".weight_scale")] = (1.0 / a).reshape(1).to(torch.float32)
        else:
            tensors[name] = t.contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": "bitlinear",
                                  "quantization_mode": "offline"}
    (path / "config.json").write_text(json.dumps(cfg))
    return path
