"""DeepSeek-V4 chat encoding against examples written from the release's documented format, and the
streaming reasoning / DSML tool-call parser fed every split of the same output."""
import json

import pytest

from sparseserve.chat import (ChatFormatError, DeepSeekV4OutputParser, chat_format_of, encode_messages,
                              merge_tool_call_deltas, parse_output, render_chat)
from sparseserve.chat.deepseek_v4 import TOOLS_PROMPT

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def test_system_and_one_user_turn_thinking_and_chat():
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}]
    assert encode_messages(msgs, thinking=True) == f"{B}You are a helpful assistant.{U}What is 2+2?{A}<think>"
    assert encode_messages(msgs, thinking=False) == f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>"


def test_multi_turn_drops_earlier_reasoning_in_thinking_mode():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
            {"role": "user", "content": "1+1?"}]
    assert encode_messages(msgs, thinking=True) == f"{B}{U}hi{A}</think>Hello.{E}{U}1+1?{A}<think>"
    assert encode_messages(msgs, thinking=False) == f"{B}{U}hi{A}</think>Hello.{E}{U}1+1?{A}</think>"
    kept = encode_messages(msgs, thinking=True, drop_thinking=False)
    assert kept == f"{B}{U}hi{A}<think>greet back</think>Hello.{E}{U}1+1?{A}<think>"


def test_reasoning_effort_max_prefix_only_in_thinking_mode():
    msgs = [{"role": "user", "content": "q"}]
    assert encode_messages(msgs, thinking=True, reasoning_effort="max").startswith(B + "Reasoning Effort: Absolute")
    assert encode_messages(msgs, thinking=False, reasoning_effort="max") == f"{B}{U}q{A}</think>"
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == f"{B}{U}q{A}<think>"


def test_tool_definition_call_and_result():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "", "reasoning_content": "need tools",
             "tool_calls": [{"id": "a", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}},
                            {"id": "b", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "b", "content": "sunny"},
            {"role": "tool", "tool_call_id": "a", "content": "rain"}]
    tools_block = TOOLS_PROMPT.replace("{schemas}", json.dumps(WEATHER["function"], ensure_ascii=False))
    calls = (f"\n\n<{D}tool_calls>\n"
             f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
             f"</{D}invoke>\n"
             f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
             f"</{D}tool_calls>")
    # With tools the reasoning of earlier turns is kept; results follow the calls' order.
    expected = (f"{B}Be brief.\n\n{tools_block}{U}Weather in Paris and Rome?{A}<think>need tools</think>{calls}{E}"
                f"{U}<tool_result>rain</tool_result>\n\n<tool_result>sunny</tool_result>{A}<think>")
    assert encode_messages(msgs, thinking=True, tools=[WEATHER]) == expected
    # Without a system message the tool block opens the prompt.
    assert encode_messages(msgs[1:2], tools=[WEATHER]) == f"{B}\n\n{tools_block}{U}Weather in Paris and Rome?{A}</think>"


def test_bad_conversations_raise_chat_format_error():
    with pytest.raises(ChatFormatError, match="empty"):
        encode_messages([])
    with pytest.raises(ChatFormatError, match="role"):
        encode_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "x"}], reasoning_effort="extreme")
    with pytest.raises(ChatFormatError, match="not valid JSON"):
        encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])


class _Tok:
    def __init__(self, vocab, template=None):
        self._vocab, self.chat_template = vocab, template

    def get_vocab(self):
        return self._vocab

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True, **kw):
        return "|".join(m["content"] for m in messages) + ("|gen" if add_generation_prompt else "")


def test_render_chat_picks_the_format():
    v4 = _Tok({t: i for i, t in enumerate([B, E, U, A])})
    assert chat_format_of(v4) == "deepseek_v4"
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(msgs, v4, chat_template_kwargs={"thinking": True}) == f"{B}{U}x{A}<think>"
    assert render_chat(msgs, v4) == f"{B}{U}x{A}</think>"
    assert render_chat(msgs, _Tok({}, template="{{x}}")) == "x|gen"
    with pytest.raises(ChatFormatError, match="no chat format"):
        render_chat(msgs, _Tok({"a": 0}))
    with pytest.raises(ChatFormatError, match="chat_template_kwargs"):
        render_chat(msgs, v4, chat_template_kwargs={"colour": 1})


# ---- output parsing ----
OUTPUTS = [
    # (thinking, text, reasoning, content, [(name, arguments)])
    (True, f"Simple arithmetic.</think>2 + 2 = 4.{E}", "Simple arithmetic.", "2 + 2 = 4.", []),
    (False, "Just content, with <b>tags</b> and a < sign.", None, "Just content, with <b>tags</b> and a < sign.", []),
    (True, f"<think>Plan.</think>Calling.\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
           f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
           f"<{D}parameter name=\"days\" string=\"false\">[1, 2]</{D}parameter>\n</{D}invoke>\n"
           f"<{D}invoke name=\"now\">\n</{D}invoke>\n</{D}tool_calls>{E}",
     "Plan.", "Calling.", [("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})]),
    (False, f"\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">a </ b"
            f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>", None, "", [("f", {"x": "a </ b"})]),
    (True, f"thinking only, cut off by max_tokens </thi", "thinking only, cut off by max_tokens </thi", "", []),
    (False, f"Text then a cut tool block\n\n<{D}tool_calls>\n<{D}invoke name=\"g\">\n<{D}param", None,
     "Text then a cut tool block", [("g", {})]),
]


def _feed(thinking, pieces):
    parser = DeepSeekV4OutputParser(thinking, call_ids=lambda: "id")
    reasoning, content, deltas = "", "", []
    for piece in pieces:
        d = parser.feed(piece)
        assert D not in d.content and "</think>" not in d.content and E not in d.content
        reasoning, content = reasoning + d.reasoning_content, content + d.content
        deltas += d.tool_calls
    d = parser.finish()
    return reasoning + d.reasoning_content, content + d.content, merge_tool_call_deltas(deltas + d.tool_calls)


def _check(thinking, text, reasoning, content, calls, got):
    r, c, tc = got
    assert (r if thinking else None) == reasoning
    assert c == content
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in tc] == calls


@pytest.mark.parametrize("case", OUTPUTS)
def test_parse_output_examples(case):
    thinking, text, reasoning, content, calls = case
    _check(thinking, text, reasoning, content, calls, parse_output(text, thinking=thinking))


@pytest.mark.parametrize("case", OUTPUTS)
def test_every_split_into_two_and_three_pieces_gives_the_same_answer(case):
    thinking, text, reasoning, content, calls = case
    n = len(text)
    for i in range(n + 1):
        _check(thinking, text, reasoning, content, calls, _feed(thinking, [text[:i], text[i:]]))
    step = max(1, n // 40)  # three pieces: every first cut, second cuts on a grid
    for i in range(n + 1):
        for j in range(i, n + 1, step):
            _check(thinking, text, reasoning, content, calls, _feed(thinking, [text[:i], text[i:j], text[j:]]))


@pytest.mark.parametrize("case", OUTPUTS)
def test_character_and_token_level_streams(case):
    thinking, text, reasoning, content, calls = case
    _check(thinking, text, reasoning, content, calls, _feed(thinking, list(text)))
    import re
    tokens = re.findall(r"<｜|｜>|\w+|\s|.", text)  # marker pieces split like a BPE vocabulary might
    assert "".join(tokens) == text
    _check(thinking, text, reasoning, content, calls, _feed(thinking, tokens))
