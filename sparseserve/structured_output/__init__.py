"""Structured outputs: grammars compiled by xgrammar (imported lazily), per-request matcher
state, and token bitmasks filled on the host and applied to the logits before sampling."""
from .grammar import GrammarCompilerCache, GrammarState, StructuredOutputsError, StructuredOutputsUnavailable

__all__ = ["GrammarCompilerCache", "GrammarState", "StructuredOutputsError", "StructuredOutputsUnavailable"]
