"""Grammar compilation (xgrammar) and the per-request matcher state.

xgrammar is imported only when a request asks for structured outputs, so an engine without it
runs every other request; such a request then fails with `StructuredOutputsUnavailable`."""
from __future__ import annotations

import json

from ..sampling_params import StructuredOutputsParams

_MAX_CACHED = 256
_BATCH_MATCHERS: dict[int, object] = {}  # id(xgrammar module) -> its BatchGrammarMatcher (None: not in this version)


class StructuredOutputsError(ValueError):
    """A structured_outputs constraint cannot be compiled; the message names it and the cause."""


class StructuredOutputsUnavailable(StructuredOutputsError):
    """structured_outputs needs the xgrammar package."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputsUnavailable(
            "structured_outputs needs the xgrammar package, which is not installed; "
            "run `pip install xgrammar` or drop structured_outputs from the request") from exc
    return xgrammar


def _choice_grammar(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompilerCache:
    """Compiles constraints for one tokenizer and vocabulary; compiled grammars are cached by constraint."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        if tokenizer is None:
            raise StructuredOutputsError("structured_outputs needs a tokenizer; this engine was started without one")
        xgr = _xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._cache: dict[tuple, object] = {}

    def compile(self, so: StructuredOutputsParams):
        key = so.key()
        compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        c = self._compiler
        try:
            if so.json is not None:
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                compiled = c.compile_json_schema(schema, any_whitespace=not so.disable_any_whitespace,
                                                 strict_mode=True)
            elif so.json_object:
                compiled = c.compile_builtin_json_grammar()
            elif so.regex is not None:
                compiled = c.compile_regex(so.regex)
            elif so.choice is not None:
                compiled = c.compile_grammar(_choice_grammar(list(so.choice)))
            else:
                compiled = c.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            which = next(n for n in ("json", "regex", "choice", "grammar", "json_object")
                         if getattr(so, n) not in (None, False))
            raise StructuredOutputsError(f"structured_outputs.{which} could not be compiled: {exc}; "
                                         "fix the constraint") from exc
        if len(self._cache) >= _MAX_CACHED:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = compiled
        return compiled

    def new_state(self, so: StructuredOutputsParams, max_rollback: int) -> GrammarState:
        return GrammarState(self._xgr, self.compile(so), max_rollback)


class GrammarState:
    """One request's position in its grammar. `accept` advances it by an output token;
    `fill` writes the bitmask of the tokens allowed after a (draft) prefix, leaving the state as it was."""

    def __init__(self, xgr, compiled, max_rollback: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max(max_rollback, 1))

    @property
    def matcher(self):
        return self._matcher

    def batch_matcher(self):
        """xgrammar's BatchGrammarMatcher (fills many matchers' bitmasks in one call), or None where
        the installed xgrammar has none."""
        key = id(self._xgr)
        if key not in _BATCH_MATCHERS:
            cls = getattr(self._xgr, "BatchGrammarMatcher", None)
            _BATCH_MATCHERS[key] = cls() if cls is not None else None
        return _BATCH_MATCHERS[key]

    def accept(self, token: int) -> bool:
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill(self, bitmask, index: int, prefix: list[int]) -> None:
        m = self._matcher
        if not prefix:
            if m.is_terminated():
                bitmask[index] = -1
            else:
                m.fill_next_token_bitmask(bitmask, index)
            return
        advanced = 0
        for token in prefix:
            if m.is_terminated() or not m.accept_token(token):
                break
            advanced += 1
        if advanced < len(prefix):
            bitmask[index] = -1  # a rejected draft before this position: the row is never used
        elif m.is_terminated():
            bitmask[index] = -1
        else:
            m.fill_next_token_bitmask(bitmask, index)
        if advanced:
            m.rollback(advanced)
