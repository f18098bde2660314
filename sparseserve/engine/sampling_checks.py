"""Checks and preparation of the logits-processing fields of SamplingParams that need the
engine's facts (vocabulary size, tokenizer): token ids in range, bad_words tokenised, grammars
compiled. Errors are `InvalidRequestError`s naming the field, the value and what to change."""
from __future__ import annotations

from ..sampling_params import SamplingParams


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word as it is and with a leading space (the space form only when it makes
    a different first token and the same number of tokens), without special tokens."""
    result: list[list[int]] = []
    for word in words:
        for add_space in (False, True):
            text = (" " if add_space else "") + word.lstrip()
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                continue
            if not add_space:
                result.append(ids)
            elif result and ids[0] != result[-1][0] and len(ids) == len(result[-1]):
                result.append(ids)
    return result


def prepare_logits_fields(params: SamplingParams, vocab_size: int, tokenizer, grammars, error) -> None:
    """Validate params against the engine and fill `params.bad_words_token_ids`; compile the grammar
    (`grammars()` returns the engine's GrammarCompilerCache). `error` is the exception type to raise."""
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise error(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size}); "
                        "remove it or use an id below the vocabulary size")
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if t >= vocab_size]
        if bad:
            raise error(f"allowed_token_ids has {bad[0]}, outside the vocabulary [0, {vocab_size}); "
                        "give ids below the vocabulary size")
    if params.bad_words:
        if tokenizer is None:
            raise error("bad_words needs a tokenizer, and this engine has none; drop bad_words "
                        "(or ban token ids with logit_bias set to -100)")
        params.bad_words_token_ids = [w for w in tokenize_bad_words(tokenizer, params.bad_words)
                                      if all(t < vocab_size for t in w)]
    if params.structured_outputs is not None:
        from ..structured_output import StructuredOutputsError

        try:
            grammars().compile(params.structured_outputs)
        except StructuredOutputsError as exc:
            raise error(str(exc)) from exc


def needs_host_state(params: SamplingParams) -> bool:
    """True when the sampler needs every earlier output token on the host (a grammar's state, the
    prefix of a multi-token bad word), so a step for the request cannot be launched while the
    previous one is in flight."""
    return params.structured_outputs is not None or any(len(w) > 1 for w in params.bad_words_token_ids)
