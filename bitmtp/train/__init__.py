"""Training MTP adapters (``python -m bitmtp train``): data, the packed layout, the differentiable
view of a frozen base, and the trainer."""

from bitmtp.train.data import answer_windows, token_windows
from bitmtp.train.masks import packed_layout, packed_layout_reference, sample_anchors
from bitmtp.train.trainer import TrainConfig, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train", "token_windows", "answer_windows", "packed_layout",
           "packed_layout_reference", "sample_anchors"]
