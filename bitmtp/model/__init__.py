"""Model layer: ModelArgs, the decoder (llama / qwen3 / bitnet families) and checkpoint loaders."""

from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import Decoder, StepInputs

__all__ = ["ModelArgs", "Decoder", "StepInputs"]
