"""Chat prompts and chat output parsing, shared by the server and `LLM.chat`.

`render_chat(messages, tokenizer, ...)` picks the format from the tokenizer (`chat_format_of`):
- a tokenizer with a `chat_template` renders through `apply_chat_template`;
- a tokenizer without one whose vocabulary has DeepSeek-V4's role tokens renders DeepSeek-V4's own
  format (`deepseek_v4.encode_messages`; the release ships no Jinja template);
- anything else raises `ChatFormatError` (the server answers 400).
Thinking mode is `chat_template_kwargs={"thinking": True}` (or `enable_thinking`, as vLLM reads
them); `reasoning_effort` ("high" or "max") and `drop_thinking` pass through the same dict.
"""
from __future__ import annotations

from .deepseek_v4 import ROLE_TOKENS, ChatFormatError, encode_messages
from .parsers import DeepSeekV4OutputParser, DeltaMessage, ToolCallDelta, merge_tool_call_deltas, parse_output

DEEPSEEK_V4 = "deepseek_v4"
TEMPLATE = "template"

__all__ = ["ChatFormatError", "DeepSeekV4OutputParser", "DeltaMessage", "ToolCallDelta", "chat_format_of",
           "encode_messages", "merge_tool_call_deltas", "parse_output", "render_chat", "thinking_enabled",
           "DEEPSEEK_V4", "TEMPLATE"]


def chat_format_of(tokenizer) -> str | None:
    """'template', 'deepseek_v4' or None (this model has no chat format)."""
    if tokenizer is None:
        return None
    if getattr(tokenizer, "chat_template", None):
        return TEMPLATE
    vocab = tokenizer.get_vocab()
    if all(token in vocab for token in ROLE_TOKENS):
        return DEEPSEEK_V4
    return None


def thinking_enabled(chat_template_kwargs: dict | None) -> bool:
    kwargs = chat_template_kwargs or {}
    return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))


def render_chat(messages: list[dict], tokenizer, *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of a conversation (OpenAI message shapes) for this tokenizer's model."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list of messages")
    kwargs = dict(chat_template_kwargs or {})
    fmt = chat_format_of(tokenizer)
    if fmt == TEMPLATE:
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise ChatFormatError(f"the model's chat template failed on these messages: {exc}") from exc
    if fmt == DEEPSEEK_V4:
        unknown = set(kwargs) - {"thinking", "enable_thinking", "reasoning_effort", "drop_thinking"}
        if unknown:
            raise ChatFormatError(f"chat_template_kwargs {sorted(unknown)} are not understood by the DeepSeek-V4 "
                                  "format; it takes thinking, enable_thinking, reasoning_effort, drop_thinking")
        prompt = encode_messages(messages, thinking=thinking_enabled(kwargs), tools=tools,
                                 reasoning_effort=kwargs.get("reasoning_effort"),
                                 drop_thinking=bool(kwargs.get("drop_thinking", True)))
        if not add_generation_prompt and prompt.endswith(("<｜Assistant｜><think>", "<｜Assistant｜></think>")):
            prompt = prompt[:prompt.rindex("<｜Assistant｜>")]
        return prompt
    raise ChatFormatError("this model has no chat format: its tokenizer has no chat_template and is not a "
                          "DeepSeek-V4 tokenizer; use /v1/completions with a plain prompt")
