"""Distributed training with the loss: data parallel (DDP, FSDP2) normalisers and vocabulary-parallel heads."""

from .data_parallel import DataParallelCosineDistillLoss, DataParallelJSDLoss, data_parallel_num_valid_tokens
from .vocab_parallel import VocabParallelOptions

__all__ = ["DataParallelCosineDistillLoss", "DataParallelJSDLoss", "VocabParallelOptions", "data_parallel_num_valid_tokens"]
