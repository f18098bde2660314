"""DeepSeek-V4's chat prompt format, as the release defines it (its `encoding/encoding_dsv4.py`; there is
no Jinja template). docs/serving.md describes the format and the source checked.

Conversation: BOS, then per message
- system: its text as is (a tool block and a response-format block appended after a blank line);
- user: `<｜User｜>` + text; OpenAI `tool` messages join the user turn that follows the assistant's
  calls as `<tool_result>...</tool_result>` blocks (blocks separated by a blank line, in call order);
- assistant: [reasoning + `</think>`] + content + [a DSML tool-call block] + EOS;
after a user turn that the assistant answers next: `<｜Assistant｜>` and `<think>` (thinking mode, the
last user turn) or `</think>` (chat mode, or an earlier turn whose reasoning was dropped).
"""
from __future__ import annotations

import copy
import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"
ROLE_TOKENS = (BOS, EOS, USER, ASSISTANT)  # their presence in a vocabulary marks a V4 tokenizer

# The release's prompt texts, reproduced exactly: the model was trained on them.
REASONING_EFFORT_MAX_PROMPT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatFormatError(ValueError):
    """The conversation cannot be rendered (no chat format, or a malformed message)."""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatFormatError(f"{where}: content part of type {kind!r} is not supported; send text parts")
        return "".join(parts)
    raise ChatFormatError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def render_tools(tools: list[dict]) -> str:
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        functions.append(fn)
    return TOOLS_PROMPT.replace("{schemas}", "\n".join(_json(f) for f in functions))


def render_tool_call(name: str, arguments: Any) -> str:
    """One call as a DSML invoke: string values as is (string="true"), others as JSON."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatFormatError(f"tool call {name!r}: arguments are not valid JSON ({exc})") from exc
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"tool call {name!r}: arguments must be a JSON object")
    params = [f'{PARAM_START} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
              f'{value if isinstance(value, str) else _json(value)}{PARAM_END}' for key, value in arguments.items()]
    return f'{INVOKE_START} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}"


def render_tool_calls(tool_calls: list[dict]) -> str:
    invokes = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"tool_calls[{i}] must carry function.name and function.arguments")
        invokes.append(render_tool_call(fn["name"], fn.get("arguments", "{}")))
    return "\n\n" + TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """OpenAI `tool` messages become tool-result blocks of a user turn; consecutive user and tool messages
    form one user turn (blocks joined by a blank line). Results are put in the order of the assistant's
    calls."""
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            call_order = {c.get("id"): k for k, c in enumerate(msg["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        if role in ("tool", "user"):
            body = _text(msg.get("content"), f"messages[{i}]")
            block = ("tool", msg.get("tool_call_id") or "", body) if role == "tool" else ("text", "", body)
            if merged and "blocks" in merged[-1]:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        else:
            merged.append(dict(msg))
        if "blocks" in merged[-1]:
            blocks = merged[-1]["blocks"]
            results = sorted((b for b in blocks if b[0] == "tool"), key=lambda b: call_order.get(b[1], 0))
            it = iter(results)
            merged[-1]["blocks"] = [next(it) if b[0] == "tool" else b for b in blocks]
    return merged


def _user_text(msg: dict) -> str:
    return "\n\n".join(f"<tool_result>{body}</tool_result>" if kind == "tool" else body
                       for kind, _, body in msg["blocks"])


def encode_messages(messages: list[dict], *, thinking: bool = False, tools: list[dict] | None = None,
                    reasoning_effort: str | None = None, drop_thinking: bool = True,
                    add_bos: bool = True) -> str:
    """The prompt for `messages` (OpenAI shapes); it ends with the assistant's opening when the last
    message is a user turn."""
    if not messages:
        raise ChatFormatError("messages is empty; give at least one message")
    if reasoning_effort not in (None, "high", "max"):
        raise ChatFormatError(f"reasoning_effort must be 'high', 'max' or None, got {reasoning_effort!r}")
    messages = [copy.copy(m) for m in messages]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer",
                                                              "latest_reminder"):
            role = m.get("role") if isinstance(m, dict) else None
            raise ChatFormatError(f"messages[{i}].role {role!r} is not one of system, user, assistant, tool, "
                                  "developer, latest_reminder")
    if tools:
        if messages[0].get("role") in ("system", "developer"):
            messages[0]["tools"] = tools
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
    msgs = _merge_tool_results(messages)
    if any(m.get("tools") for m in msgs):
        drop_thinking = False  # with tools, earlier reasoning stays in the prompt
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)
    if thinking and drop_thinking:  # earlier developer turns go; earlier assistant turns lose their reasoning
        msgs = [m for i, m in enumerate(msgs) if not (m["role"] == "developer" and i < last_user)]
        last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)

    prompt = BOS if add_bos else ""
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX_PROMPT
    for i, msg in enumerate(msgs):
        role, where = msg["role"], f"messages[{i}]"
        if role == "system":
            prompt += _text(msg.get("content"), where)
            if msg.get("tools"):
                prompt += "\n\n" + render_tools(msg["tools"])
            if msg.get("response_format"):
                prompt += "\n\n" + RESPONSE_FORMAT_PROMPT + _json(msg["response_format"])
        elif role == "developer":
            prompt += USER + _text(msg.get("content"), where)
            if msg.get("tools"):
                prompt += "\n\n" + render_tools(msg["tools"])
        elif role == "user":
            prompt += USER + _user_text(msg)
        elif role == "latest_reminder":
            prompt += LATEST_REMINDER + _text(msg.get("content"), where)
        else:  # assistant
            reasoning = ""
            if thinking and (not drop_thinking or i > last_user):
                reasoning = (msg.get("reasoning_content") or msg.get("reasoning") or "") + THINK_END
            calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
            prompt += reasoning + _text(msg.get("content"), where) + calls + EOS
        following = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if role in ("user", "developer") and following in (None, "assistant", "latest_reminder"):
            prompt += ASSISTANT
            prompt += THINK_START if thinking and (not drop_thinking or i >= last_user) else THINK_END
    return prompt
