"""Issue 43: tool calls read back per family format from recorded model outputs, a call never shown as text while
it streams, and thinking told apart from the answer however the tags are split. No model runs here."""
from __future__ import annotations

import json

import pytest

from engine.run.reasoning import ThinkSplitter
from engine.run.tools import FORMATS, CallStream, Choice, ToolError, ToolPlan, check_tools, parse_calls, template_format

NAMES = {"get_current_temperature", "get_current_weather", "get_weather", "add"}

# (format, what a model of that family wrote, the calls as (name, arguments), the text left)
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
               '\n</tool_call>', [("get_current_temperature", {"location": "San Francisco, CA, USA"})], ""),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
     [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})], "Let me check both."),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                '"format": "celsius"}}]', [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
     ""),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', [("get_weather", {"city": "Lima"})], ""),
    ("phi4", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|/tool_call|>',
     [("get_weather", {"city": "Oslo"})], ""),
    ("llama3", '{"name": "get_current_weather", "parameters": {"location": "San Francisco", "unit": "fahrenheit"}}',
     [("get_current_weather", {"location": "San Francisco", "unit": "fahrenheit"})], ""),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
               '"parameters": {"city": "Paris"}}', [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})], ""),
    ("json", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', [("get_weather", {"city": "Paris"})],
     ""),
    ("json", '[{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}]', [("add", {"a": 4, "b": 5})], ""),
]


@pytest.mark.parametrize("fmt, text, calls, rest", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_recorded_calls_are_read_per_family(fmt, text, calls, rest):
    left, found = parse_calls(text, FORMATS[fmt], NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls and left == rest
    # Streamed a character at a time, none of the call shows as text, and the end gives the same calls.
    stream = CallStream(FORMATS[fmt], NAMES)
    shown = "".join(stream.push(ch) for ch in text)
    tail, streamed = stream.finish()
    assert (shown + tail).strip() == rest and [(c.name, c.arguments) for c in streamed] == [
        (c.name, c.arguments) for c in found]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "No tools needed: the answer is 4."),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # no such tool
    ("json", '{"answer": 4}'),
    ("llama3", "The weather is fine."),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"add\", "),  # cut off at max_tokens
])
def test_what_only_looks_like_a_call_stays_text(fmt, text):
    left, found = parse_calls(text, FORMATS[fmt], NAMES)
    assert found == [] and left == text
    stream = CallStream(FORMATS[fmt], NAMES)
    shown = "".join(stream.push(ch) for ch in text)
    tail, calls = stream.finish()
    assert calls == [] and shown + tail == text


@pytest.mark.parametrize("template, fmt, native", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "hermes", False),  # SmolLM2: no tools
    ("{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>", "hermes", True),  # Qwen2.5 / Hermes
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]", "mistral", True),
    ("{% if tools %}<|tool|>{{ tools }}<|/tool|>{% endif %}<|tool_call|>", "phi4", True),
    ("{% if tools %}{{ tools }}{% endif %}<|start_header_id|>ipython<|end_header_id|>", "llama3", True),
    ("{% if tools %}{{ tools | tojson }}{% endif %}<start_of_turn>", "json", True),
])
def test_the_template_says_the_format(template, fmt, native):
    assert template_format(template) == (FORMATS[fmt], native)


def test_tools_and_tool_choice_are_checked():
    tools = check_tools([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    assert tools[0]["function"]["description"] == ""
    for bad in ([{"type": "function", "function": {"name": "a b"}}], [{"type": "retrieval"}], "add",
                [{"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "x"}}],
                [{"type": "function", "function": {"name": "x", "parameters": []}}]):
        with pytest.raises(ToolError):
            check_tools(bad)
    assert Choice.read(None, tools).mode == "auto" and Choice.read(None, []).mode == "none"
    assert Choice.read({"type": "function", "function": {"name": "add"}}, tools) == Choice("function", "add")
    for bad in ("sometimes", {"type": "function", "function": {"name": "sub"}}):
        with pytest.raises(ToolError):
            Choice.read(bad, tools)
    with pytest.raises(ToolError):
        Choice.read("required", [])


def test_a_template_without_tools_is_told_of_them_and_given_calls_and_results_as_text():
    tools = check_tools([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    plan = ToolPlan.make("{{ messages }}", tools, Choice("auto"))
    assert not plan.native and plan.extras() == {} and '"name": "add"' in plan.system("Be brief.")
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    shaped = plan.messages([{"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert shaped == [{"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'},
                      {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}]
    native = ToolPlan.make("{% if tools %}{{ tools }}{% endif %}<tool_call>", tools, Choice("auto"))
    assert native.extras() == {"tools": tools} and native.system(None) is None
    assert native.messages([{"role": "assistant", "content": None, "tool_calls": [call]}])[0]["tool_calls"][0][
        "function"]["arguments"] == {"a": 1}  # an object, as transformers gives templates
    # The reply as the client will send it back: the same ids however often it is parsed.
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert native.message(reply) == native.message(reply) and native.message(reply)["content"] is None


@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
def test_thinking_is_split_from_the_answer_however_the_tags_arrive(step):
    def split(text: str, inside: bool = False) -> tuple[str, str]:
        s = ThinkSplitter(inside)
        kinds = [k for i in range(0, len(text), step) for k, _ in s.push(text[i:i + step])] + [k for k, _ in s.flush()]
        assert kinds == sorted(kinds, key=lambda k: k == "content")  # thinking first, then the answer
        return "".join(s.reasoning), "".join(s.content)

    assert split("<think>\nLet me see.</think>\n\nIt is 4.") == ("\nLet me see.", "It is 4.")
    assert split("2 + 2 </thi is not a tag</think>\n\nFour", inside=True) == ("2 + 2 </thi is not a tag", "Four")
    assert split("Four. <think>late</think>") == ("", "Four. <think>late</think>")  # only at the very start
    assert split("still thinking when the tokens ran out", inside=True) == ("still thinking when the tokens ran out", "")
    assert split("\n\nPlain answer") == ("", "\n\nPlain answer")
