"""shoal: an offline inference engine for DeepSeek-V4.1-Flash (Hopper Triton kernels and a
portable PyTorch reference). Public API: LLM, SamplingParams, RequestOutput."""

from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.llm import LLM
from shoal.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
