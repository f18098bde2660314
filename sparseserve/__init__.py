"""sparseserve: an inference engine for DeepSeek-V4-class sparse-attention models."""
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"
