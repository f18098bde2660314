"""Incremental detokenisation: decode only a short window of recent tokens per step, and
hold back text that ends in an incomplete UTF-8 sequence (shown as U+FFFD)."""
from __future__ import annotations

from .request import Request


def detokenize_incrementally(tokenizer, request: Request, skip_special_tokens: bool) -> str:
    """Append the newly decodable text of `request.output_token_ids` to request.text; returns the new text."""
    ids = request.output_token_ids
    prefix_text = tokenizer.decode(ids[request.prefix_offset:request.read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(ids[request.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        new_text = full_text[len(prefix_text):]
        request.prefix_offset = request.read_offset
        request.read_offset = len(ids)
        request.text += new_text
        return new_text
    return ""
