"""Incremental detokenisation: decode only a short window of recent tokens per step, and
hold back text that ends in an incomplete UTF-8 sequence (shown as U+FFFD)."""
from __future__ import annotations

from collections.abc import Callable

from .request import Request

def fast_decode(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` for `tokenizer`. For a `tokenizers`-backed tokenizer whose
    `decode` adds nothing to the Rust tokenizer's (no clean-up of tokenization spaces, the stock
    `_decode`), the Rust call itself: the `transformers` wrapper costs about twice the decode, and
    it runs twice per token of every request. The engine makes it once, with its tokenizer."""
    decode = None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the wrapper
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and type(tokenizer)._decode is TokenizersBackend._decode
            and type(tokenizer).decode is TokenizersBackend.decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        rust_decode = backend.decode

        def decode(ids: list[int], skip_special_tokens: bool) -> str:
            return rust_decode(ids, skip_special_tokens=skip_special_tokens)
    if decode is None:
        def decode(ids: list[int], skip_special_tokens: bool) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return decode


def detokenize_incrementally(decode: Callable[[list[int], bool], str], request: Request,
                             skip_special_tokens: bool) -> str:
    """Append the newly decodable text of `request.output_token_ids` to request.text (`decode`: the
    engine's `fast_decode(tokenizer)`); returns the new text."""
    ids = request.output_token_ids
    prefix_text = decode(ids[request.prefix_offset:request.read_offset], skip_special_tokens)
    full_text = decode(ids[request.prefix_offset:], skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        new_text = full_text[len(prefix_text):]
        request.prefix_offset = request.read_offset
        request.read_offset = len(ids)
        request.text += new_text
        return new_text
    return ""
