"""On-disk and in-memory formats: the T2 packed ternary layout, scales, quantizers, BitNet conversion."""

from bitmtp.formats.bitnet import bitnet_scale_to_multiplier, bitnet_to_t2, pack_bitnet, unpack_bitnet
from bitmtp.formats.quantize import absmean_ternarize, dequantize_ternary, quantize_activations
from bitmtp.formats.scales import expand_scales, resolve_group_size
from bitmtp.formats.ternary import WEIGHTS_PER_WORD, pack_t2, padded_k, unpack_codes, unpack_t2, words_per_row

__all__ = [
    "WEIGHTS_PER_WORD",
    "pack_t2",
    "unpack_t2",
    "unpack_codes",
    "padded_k",
    "words_per_row",
    "absmean_ternarize",
    "quantize_activations",
    "dequantize_ternary",
    "resolve_group_size",
    "expand_scales",
    "unpack_bitnet",
    "pack_bitnet",
    "bitnet_to_t2",
    "bitnet_scale_to_multiplier",
]
