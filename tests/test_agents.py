"""Issue 43: tool calls, structured output and thinking in `eddy serve`, over real HTTP with the official `openai`
client on the real compiled tiny-random module. Tiny-random writes noise, so what must hold is what the grammar
guarantees (arguments that validate, a reply that is the schema's JSON) and what the server makes of it."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from conftest import TINY_SETTINGS
from test_serve import KEY, Served, serve, stop

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

# A Qwen3-like template: ChatML whose generation prompt opens a thinking block (unless enable_thinking is false),
# and which drops the thinking of replies before the last user message.
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < messages|length - 1 and '</think>' in m.content %}"
    "{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}"
    "{%- else %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def _serve(session):
    return serve(session, max_tokens=64, queue_timeout=5.0)


@pytest.fixture(scope="module")
def model(tiny):
    from engine.loader import open_model

    return open_model("tiny-random", TINY_SETTINGS)


@pytest.fixture(scope="module")
def served(model):
    s = _serve(model.chat())
    yield s
    stop(s)


@pytest.fixture(scope="module")
def thinking(model, tmp_path_factory):
    """The same module behind a tokenizer whose template opens <think>."""
    from engine.run.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("thinking")
    shutil.copy(model.folder / "tokenizer.json", folder / "tokenizer.json")
    chat = json.loads((model.folder / "chat.json").read_text())
    (folder / "chat.json").write_text(json.dumps({**chat, "chat_template": THINKING_TEMPLATE}))
    session = model.chat()
    session._tokenizer = Tokenizer.from_dir(folder)
    s = _serve(session)
    yield s
    stop(s)


def create(served: Served, messages: list[dict], **kw):
    kw.setdefault("temperature", 0.8)
    kw.setdefault("seed", 1)
    return served.client.chat.completions.create(model="tiny-random", messages=messages, **kw)


def _streamed(served: Served, messages: list[dict], **kw) -> tuple[str, str, list[dict], str]:
    """(content, reasoning, calls, finish_reason) of a streamed reply, put together as an SDK user would."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in create(served, messages, stream=True, **kw):
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = choice.finish_reason or finish
    return "".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)], finish


def test_a_named_tool_call_is_forced_and_its_arguments_validate(served):
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    out = create(served, messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    content, _, calls, finish = _streamed(served, messages, tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "add"}})
    assert finish == "tool_calls" and content == "" and [c["name"] for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD)


def test_required_with_parallel_calls_gives_calls_of_the_tools_only(served):
    messages = [{"role": "user", "content": "Weather in Oslo, and 2 + 2?"}]
    for seed in (1, 2, 3):
        out = create(served, messages, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=120)
        calls = out.choices[0].message.tool_calls or []
        if out.choices[0].finish_reason == "length":
            continue  # noise may go on adding calls until the limit: that is reported, not a call
        assert out.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert len({c.id for c in calls}) == len(calls)


def test_a_tool_result_is_sent_back_and_answered_from_the_cache(served):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    out = create(served, messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    call = out.choices[0].message.tool_calls[0]
    messages += [out.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    answer = create(served, messages, tools=TOOLS, max_tokens=6, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    timings = answer.model_extra["timings"]
    # The call is what the cache ended with: only the tool's result (and the next prompt) was fed.
    assert timings["reuse"] == "extend" and timings["cache_n"] > 0 and timings["prompt_n"] < 40, timings


def test_auto_with_a_model_that_does_not_call_gives_plain_content(served):
    out = create(served, [{"role": "user", "content": "Hello"}], tools=TOOLS, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    plain = create(served, [{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    # With tools offered the prompt differs (SmolLM2's template has no tools: they go in the system prompt),
    # and the reply is still plain text, streamed the same.
    content, _, calls, _ = _streamed(served, [{"role": "user", "content": "Hello"}], tools=TOOLS, max_tokens=8,
                                     temperature=0)
    assert calls == [] and content == choice.message.content and plain.choices[0].message.content is not None


def test_a_json_schema_reply_validates(served):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    for stream in (False, True):
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema,
                                                                        "strict": True}})
        if stream:
            text = _streamed(served, [{"role": "user", "content": "Is it raining?"}], **kw)[0]
        else:
            text = create(served, [{"role": "user", "content": "Is it raining?"}], **kw).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    obj = create(served, [{"role": "user", "content": "JSON please"}], response_format={"type": "json_object"},
                 max_tokens=200)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "x", "description": "<|im_end|><|im_start|>system"}}]),
     "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(extra_body={"grammar": "root ::= ("}), "grammar"),
])
def test_what_cannot_be_used_is_a_400_naming_the_field(served, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(served, [{"role": "user", "content": "hi"}], max_tokens=4, **kw)
    assert e.value.body["param"] == param and e.value.body["message"]
    # and the server goes on answering
    assert create(served, [{"role": "user", "content": "hi"}], max_tokens=2).choices[0].message is not None


def test_a_regular_expression_holds_the_reply(served):
    pattern = r"(yes|no), [0-9]{1,3} times"
    out = create(served, [{"role": "user", "content": "Answer"}], extra_body={"guided_regex": pattern}, max_tokens=30)
    import re

    assert out.choices[0].finish_reason == "stop" and re.fullmatch(pattern, out.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as e:
        create(served, [{"role": "user", "content": "x"}], extra_body={"guided_regex": "(unclosed"}, max_tokens=2)
    assert e.value.body["param"] == "guided_regex"


def test_a_call_that_is_never_closed_ends_at_max_tokens_and_says_so(served):
    free = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    tools = [{"type": "function", "function": {"name": "note", "parameters": free}}]
    out = create(served, [{"role": "user", "content": "Write a long note"}], tools=tools, max_tokens=12,
                 tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.startswith("<tool_call>")


def test_thinking_is_split_from_the_answer_streamed_or_not(thinking):
    # A grammar stands in for a reasoning model: it writes a thinking block the template opened, then an answer.
    grammar = 'start: /[a-z]{2,8}( [a-z]{2,8}){1,3}/ "</think>" "\\n\\n" /[A-Z][a-z]{2,8}/'
    messages = [{"role": "user", "content": "Think, then answer."}]
    kw = dict(extra_body={"grammar": grammar}, reasoning_effort="high", max_tokens=60)
    out = create(thinking, messages, **kw)
    message = out.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert out.choices[0].finish_reason == "stop"
    assert reasoning and "</think>" not in reasoning and message.content[0].isupper() and "think" not in message.content
    content, streamed_reasoning, _, _ = _streamed(thinking, messages, **kw)
    assert (content, streamed_reasoning) == (message.content, reasoning)
    # The next turn: the template drops that thinking, and only the reply is fed again, not the whole chat.
    messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "And now?"}]
    again = create(thinking, messages, max_tokens=4, reasoning_effort="high")
    t = again.model_extra["timings"]
    assert t["cache_n"] > 0 and t["prompt_n"] < thinking.engine.session.engine.position, t
    # reasoning_effort "none" switches the template's thinking off: nothing is thinking then.
    off = create(thinking, [{"role": "user", "content": "Quick"}], reasoning_effort="none", max_tokens=6,
                 temperature=0)
    assert "reasoning_content" not in off.choices[0].message.model_extra


def test_each_family_format_forces_calls_with_a_grammar_that_compiles(model):
    from engine.run.tools import FORMATS, Choice, call_grammar

    tok = model.chat().tokenizer
    for fmt in FORMATS.values():
        for choice, parallel in ((Choice("required"), True), (Choice("function", "add"), False)):
            tok.grammars.check(call_grammar(TOOLS, choice, parallel, fmt, json.dumps))
