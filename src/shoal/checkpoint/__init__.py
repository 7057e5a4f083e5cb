"""Checkpoints: the lazy safetensors `CheckpointReader` and the synthetic checkpoint writer."""

from shoal.checkpoint.reader import CheckpointError, CheckpointReader, CheckReport
from shoal.checkpoint.writer import generate_weights, make_checkpoint_main, write_checkpoint

__all__ = ["CheckReport", "CheckpointError", "CheckpointReader", "generate_weights",
           "make_checkpoint_main", "write_checkpoint"]
