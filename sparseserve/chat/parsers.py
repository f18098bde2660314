"""Streaming parsers for DeepSeek-V4 output: reasoning (`...</think>`) apart from content, and DSML
tool-call blocks turned into OpenAI tool calls.

`DeepSeekV4OutputParser.feed(text)` takes any piece of the output (a token's text, a character, a
whole answer) and returns what can be said for sure; text that could still be the start of a marker
is held back until the next piece decides, so markup never reaches `content`, however the output is
split. `finish()` flushes the rest. `parse_output` is the same machine fed the whole text at once,
so a streamed answer and a non-streamed one are equal by construction.

Rules (docs/serving.md): in thinking mode the output starts in the reasoning, which ends at
`</think>`; a tool-call block may start right after the reasoning or after content; whitespace just
before a tool-call block belongs to the markup; an EOS marker ends the message; an unterminated
parameter or invoke at the end is dropped (a call whose name was sent gets the arguments parsed so
far).
"""
from __future__ import annotations

import itertools
import json
import re
import uuid
from dataclasses import dataclass, field

from .deepseek_v4 import (EOS, INVOKE_END, INVOKE_START, PARAM_END, PARAM_START, THINK_END, THINK_START,
                          TOOL_CALLS_END, TOOL_CALLS_START)

_INVOKE_HEAD = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
_PARAM_HEAD = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _arguments_json(params: list[tuple[str, str, str]]) -> str:
    parts = []
    for name, is_string, value in params:
        if is_string == "true":
            encoded = json.dumps(value, ensure_ascii=False)
        else:
            try:
                json.loads(value)
                encoded = value.strip()
            except json.JSONDecodeError:
                encoded = json.dumps(value, ensure_ascii=False)
        parts.append(f"{json.dumps(name, ensure_ascii=False)}: {encoded}")
    return "{" + ", ".join(parts) + "}"


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class DeepSeekV4OutputParser:
    def __init__(self, thinking: bool, call_ids=None) -> None:
        self.state = "reasoning" if thinking else "content"
        self.buf = ""
        self._at_start = thinking
        self._call_ids = call_ids or _new_call_id
        self._calls = itertools.count()
        self._call: tuple[int, list] | None = None  # (index, params) of the open invoke
        self.num_tool_calls = 0

    # ---- helpers ----
    def _emit_text(self, out: DeltaMessage, text: str) -> None:
        if self.state == "reasoning":
            out.reasoning_content += text
        else:
            out.content += text

    def _text_state(self, out: DeltaMessage, final: bool) -> bool:
        """Reasoning or content: emit what is sure; True when a marker moved the state."""
        buf = self.buf
        if self._at_start:
            if THINK_START.startswith(buf) and not final:
                return False
            if buf.startswith(THINK_START):
                buf = buf[len(THINK_START):]
            self._at_start = False
        ends = (THINK_END, TOOL_CALLS_START, EOS) if self.state == "reasoning" else (TOOL_CALLS_START, EOS)
        found = [(buf.find(m), m) for m in ends if m in buf]
        if found:
            pos, marker = min(found)
            before = buf[:pos]
            if marker == TOOL_CALLS_START:
                before = before.rstrip()
            self._emit_text(out, before)
            self.buf = buf[pos + len(marker):]
            self.state = {THINK_END: "content", TOOL_CALLS_START: "tools", EOS: "done"}[marker]
            return True
        if final:
            keep = _partial_suffix(buf, ends)
            tail = buf[len(buf) - keep:] if keep else ""
            # A cut-off marker (it has the markup's full-width bar) is dropped, other text is kept.
            self._emit_text(out, buf[:len(buf) - keep] + ("" if "｜" in tail else tail))
            self.buf = ""
            return False
        keep = _partial_suffix(buf, ends)
        sure = buf[:len(buf) - keep]
        stripped = sure.rstrip()  # whitespace may still turn out to precede a tool-call block
        self._emit_text(out, stripped)
        self.buf = sure[len(stripped):] + buf[len(buf) - keep:]
        return False

    def _skip_junk(self, markers: tuple[str, ...]) -> bool:
        """Drop leading whitespace, and text that cannot start a marker; False when waiting for more."""
        self.buf = self.buf.lstrip()
        if not self.buf:
            return False
        if any(self.buf.startswith(m) or m.startswith(self.buf) for m in markers):
            return True
        nxt = self.buf.find("<", 1)
        self.buf = self.buf[nxt:] if nxt != -1 else ""
        return bool(self.buf)

    def _tools_state(self, out: DeltaMessage) -> bool:
        if not self._skip_junk((TOOL_CALLS_END, INVOKE_START)):
            return False
        if self.buf.startswith(TOOL_CALLS_END):
            self.buf = self.buf[len(TOOL_CALLS_END):]
            self.state = "after"
            return True
        match = _INVOKE_HEAD.match(self.buf)
        if match is None:
            if ">" in self.buf:  # a malformed invoke head: drop it
                self.buf = self.buf[self.buf.index(">") + 1:]
                return True
            return False
        index = next(self._calls)
        self.num_tool_calls += 1
        self._call = (index, [])
        out.tool_calls.append(ToolCallDelta(index=index, id=self._call_ids(), name=match.group(1)))
        self.buf = self.buf[match.end():]
        self.state = "invoke"
        return True

    def _invoke_state(self, out: DeltaMessage) -> bool:
        if not self._skip_junk((INVOKE_END, PARAM_START)):
            return False
        if self.buf.startswith(INVOKE_END):
            self._close_call(out)
            self.buf = self.buf[len(INVOKE_END):]
            self.state = "tools"
            return True
        match = _PARAM_HEAD.match(self.buf)
        if match is None:
            if ">" in self.buf:
                self.buf = self.buf[self.buf.index(">") + 1:]
                return True
            return False
        end = self.buf.find(PARAM_END, match.end())
        if end == -1:
            return False
        self._call[1].append((match.group(1), match.group(2), self.buf[match.end():end]))
        self.buf = self.buf[end + len(PARAM_END):]
        return True

    def _close_call(self, out: DeltaMessage) -> None:
        index, params = self._call
        out.tool_calls.append(ToolCallDelta(index=index, arguments=_arguments_json(params)))
        self._call = None

    def _after_state(self) -> bool:
        self.buf = self.buf.lstrip()
        if not self.buf:
            return False
        if self.buf.startswith(EOS):
            self.state = "done"
            return True
        if EOS.startswith(self.buf):
            return False
        self.state = "content"
        return True

    # ---- the interface ----
    def feed(self, text: str) -> DeltaMessage:
        out = DeltaMessage()
        self.buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        self._run(out, final=True)
        if self._call is not None:
            self._close_call(out)
        self.buf = ""
        return out

    def _run(self, out: DeltaMessage, final: bool) -> None:
        while True:
            if self.state == "done":
                self.buf = ""
                return
            if self.state in ("reasoning", "content"):
                moved = self._text_state(out, final)
            elif self.state == "tools":
                moved = self._tools_state(out)
            elif self.state == "invoke":
                moved = self._invoke_state(out)
            else:
                moved = self._after_state()
            if not moved:
                return


def merge_tool_call_deltas(deltas: list[ToolCallDelta]) -> list[dict]:
    """OpenAI tool calls from a stream of deltas."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.id is not None:
            call["id"] = d.id
        if d.name is not None:
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def parse_output(text: str, *, thinking: bool = False, call_ids=None) -> tuple[str | None, str, list[dict]]:
    """(reasoning_content, content, tool_calls) of a whole DeepSeek-V4 answer; reasoning is None in chat
    mode."""
    parser = DeepSeekV4OutputParser(thinking, call_ids)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning_content + last.reasoning_content
    return (reasoning if thinking else None, first.content + last.content,
            merge_tool_call_deltas(first.tool_calls + last.tool_calls))
