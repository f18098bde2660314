"""sparseserve: an inference engine for DeepSeek-V4-class sparse-attention models."""
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
