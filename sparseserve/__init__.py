"""sparseserve: an inference engine for DeepSeek-V4-class sparse-attention models."""
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"
