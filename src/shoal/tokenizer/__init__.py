"""Tokenizer package: `Tokenizer` (tokenizer.json wrapper), `IncrementalDetokenizer`, and the
synthetic byte-level BPE used by test checkpoints; `encoding` renders chat prompts."""

from shoal.tokenizer.synthetic import build_synthetic_tokenizer
from shoal.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "build_synthetic_tokenizer"]
