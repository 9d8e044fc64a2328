"""The chat renderers against the official chat formats (``chat_references.py``), byte for byte and id for id.

- Kimi Linear: ours == the K2-Instruct-family template's string as ``tokenization_kimi.py`` renders it; ids == that
  string encoded with the fixture tokenizer's special-token parsing (where no message text spells a special token).
- Kimi-K3: ours == Moonshot's encoder: the same segments (text, and which are control tokens), text, and ids as
  mlx-vlm encodes the segments, with the ``k3-vl-tiny`` tokenizer (K3's control tokens); and == llama.cpp's
  ``Kimi-K3.jinja`` given the conversation after the encoder's own ``normalize_conversation`` (the one place the port
  differs: it writes JSON-string arguments as a raw json block; its ``dictsort`` also ignores case, so generated keys
  are lower case here and the case-sensitive order is checked against the encoder alone).
- ``tokenizer.apply_chat_template`` gives the same ids as ``render_chat`` on every conversation.

Conversations come from a hypothesis generator (fixed seed: the same examples every run) covering tool calls with
typed, JSON-string, blank and non-JSON arguments, client ids or none, tool results named or not and out of call
order, several tool rounds, reasoning, system prompts present or absent, user names, multi-part and empty content,
and for K3 thinking on/off, each effort, tool_choice and response_format; plus named hand-written conversations.
"""

import json

import pytest
from chat_references import K3_TEMPLATE, encoder_ids, k2_reference, k3_reference, k3_template
from conftest import KL_FIXTURE, SHARED
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_mlx.chat.format import (
    K2_DEFAULT_SYSTEM,
    render_chat,
    render_chat_segments,
    render_chat_text,
)
from kimi_mlx.chat.tokenizer import load_kimi_tokenizer

K3_VL = SHARED / "fixtures" / "k3_vision" / "k3-vl-tiny"
EXAMPLES = 60  # generated conversations per format


@pytest.fixture(scope="module")
def kltok():
    return load_kimi_tokenizer(KL_FIXTURE / "hf")


@pytest.fixture(scope="module")
def k3tok():
    return load_kimi_tokenizer(K3_VL)


def check_kimi_linear(tok, messages, tools=None, add_generation_prompt=True):
    """Ours == the template's text; ids == the template string's (when no message spells a special token);
    ``apply_chat_template`` gives the same ids."""
    want = k2_reference(messages, tools, add_generation_prompt)
    kw = {"tools": tools, "add_generation_prompt": add_generation_prompt, "default_system": K2_DEFAULT_SYSTEM}
    assert render_chat_text(tok, messages, **kw) == want
    ids = render_chat(tok, messages, **kw)
    assert tok.apply_chat_template(messages, **kw) == ids
    if "<|" not in json.dumps([messages, tools], ensure_ascii=False):
        assert ids == tok.encode(want, allowed_special="all")
    return want


def check_k3(tok, messages, tools=None, **options):
    """Ours == the encoder's segments (text and which are control tokens), text and ids; == the Jinja port's text;
    ``apply_chat_template`` gives the same ids. ``options``: thinking, thinking_effort, add_generation_prompt,
    tool_choice, response_format (passed explicitly to every side)."""
    segments = k3_reference(messages, tools, **options)
    want = "".join(s.text for s in segments)
    ours = [seg for seg in render_chat_segments(messages, chat_format="kimi_k3", tools=tools, **options) if seg[1]]
    assert ours == [(s.allow_special, s.text) for s in segments]
    assert render_chat_text(tok, messages, tools=tools, **options) == want
    assert k3_template(messages, tools, **options) == want
    ids = render_chat(tok, messages, tools=tools, **options)
    assert ids == encoder_ids(segments, tok)
    assert tok.apply_chat_template(messages, tools=tools, **options) == ids
    return want


# ----------------------------------------------------------------------------------------------- the generator

KEYS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)
TEXTS = st.one_of(
    st.sampled_from(["", " ", "Weather in Tokyo?", "a\nb\n", "22C sunny", "你好，世界", "  padded  ",
                     'say "hi" & bye', "emoji 🌧", '{"json": 1}', "typed <|im_end|> and <|open|>message<|sep|>"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="<"), max_size=24),
)
FUNCTIONS = ["get_weather", "get_time", "search", "run_tests", "a-b.c"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), TEXTS)
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(KEYS, kids, max_size=3),
                      max_leaves=6)
ARG_DICTS = st.dictionaries(KEYS, VALUES, max_size=4)
ARGUMENTS = st.one_of(
    ARG_DICTS,  # typed
    ARG_DICTS.map(json.dumps),  # a JSON object string, as OpenAI clients send it
    ARG_DICTS.map(lambda d: json.dumps(d, ensure_ascii=False, separators=(",", ":"))),
    st.sampled_from(["", "  ", "{not json", '{"city": "Tok']),  # blank, or not JSON
)


def shuffled(d: dict):
    """``d`` with its keys in a drawn order."""
    return st.permutations(list(d.items())).map(dict)


PARAMETER = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "number", "boolean", "object", "array"])},
    optional={"description": TEXTS, "enum": st.lists(TEXTS, min_size=1, max_size=2)},
).flatmap(shuffled)
TOOL = st.builds(
    lambda name, desc, props, required: {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": required}}},
    st.sampled_from(FUNCTIONS), TEXTS, st.dictionaries(KEYS, PARAMETER, max_size=3), st.lists(KEYS, max_size=2),
).flatmap(lambda t: st.tuples(shuffled(t), shuffled(t["function"])).map(lambda p: {**p[0], "function": p[1]}))
TOOLS = st.none() | st.lists(TOOL, min_size=1, max_size=3)
CONTENT = st.one_of(TEXTS, st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXTS), min_size=1, max_size=3))


@st.composite
def conversations(draw, k3: bool):
    """``(messages, tools, add_generation_prompt)``: 1-4 user turns, each answered by 0-2 tool rounds (calls, then
    their results) and a final answer (the last one may be left for the generation prompt)."""
    messages: list = []
    if draw(st.booleans()):
        system = {"role": "system", "content": draw(CONTENT)}
        if draw(st.integers(0, 4)) == 0:
            system["name"] = draw(st.sampled_from(["ops", 'a"b&c']))
        messages.append(system)
    n_calls = 0
    rounds = draw(st.integers(1, 4))
    for r in range(rounds):
        user = {"role": "user", "content": draw(CONTENT)}
        if draw(st.integers(0, 4)) == 0:
            user["name"] = draw(st.sampled_from(["bob", "日本"]))
        messages.append(user)
        for _ in range(draw(st.integers(0, 2))):
            with_ids = draw(st.booleans())
            calls = []
            for fn in draw(st.lists(st.sampled_from(FUNCTIONS), min_size=1, max_size=3)):
                call = {"type": "function", "function": {"name": fn, "arguments": draw(ARGUMENTS)}}
                if with_ids:
                    call["id"] = f"call_{n_calls}"
                calls.append(call)
                n_calls += 1
            assistant = {"role": "assistant", "content": draw(st.none() | CONTENT), "tool_calls": calls}
            if draw(st.booleans()):
                assistant["reasoning_content"] = draw(TEXTS)
            messages.append(assistant)
            results = []
            for k, call in enumerate(calls):
                result = {"role": "tool", "content": draw(CONTENT)}
                id_kind = draw(st.sampled_from(["client", "template", "none"]))
                if id_kind == "client" and with_ids:
                    result["tool_call_id"] = call["id"]
                elif id_kind == "template":
                    result["tool_call_id"] = f"functions.{call['function']['name']}:{n_calls - len(calls) + k}"
                name = draw(st.sampled_from([None, "function", "other"]))
                if name:
                    result["name"] = call["function"]["name"] if name == "function" else "other"
                results.append(result)
            if with_ids and draw(st.booleans()):
                results = draw(st.permutations(results))  # a client answering out of call order
            messages += results
        if k3 and draw(st.integers(0, 5)) == 0:
            messages.append({"role": "system", "tools": draw(st.lists(TOOL, min_size=1, max_size=2))})
        if r < rounds - 1 or draw(st.booleans()):
            answer = {"role": "assistant", "content": draw(st.none() | CONTENT)}
            if draw(st.booleans()):
                answer["reasoning_content"] = draw(TEXTS)
            messages.append(answer)
    return messages, draw(TOOLS), messages[-1]["role"] != "assistant"


K3_OPTIONS = st.fixed_dictionaries({
    "thinking": st.booleans(),
    "thinking_effort": st.sampled_from(["low", "high", "max"]),
    "tool_choice": st.sampled_from([None, "auto", "required", "none"]),
    "response_format": st.sampled_from([
        None, {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "required": ["city"], "properties": {"temp": {"type": "number"},
                                                                   "city": {"type": "string"}}}}}]),
})
GENERATED = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@GENERATED
@given(conversation=conversations(k3=False))
def test_kimi_linear_generated_conversations_match_the_template(kltok, conversation):
    messages, tools, add_generation_prompt = conversation
    check_kimi_linear(kltok, messages, tools, add_generation_prompt)


@GENERATED
@given(conversation=conversations(k3=True), options=K3_OPTIONS)
def test_k3_generated_conversations_match_the_encoder(k3tok, conversation, options):
    messages, tools, add_generation_prompt = conversation
    check_k3(k3tok, messages, tools, add_generation_prompt=add_generation_prompt, **options)


# ----------------------------------------------------------------------------------------------- named conversations

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Zeit für eine Stadt",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
USER = {"role": "user", "content": "Weather and time in Tokyo?"}


def _calls(*specs, ids=False):
    out = []
    for i, (name, args) in enumerate(specs):
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        if ids:
            call["id"] = f"call_{name}_{i}"
        out.append(call)
    return out


TWO_CALLS = _calls(("get_weather", {"city": "Tokyo"}), ("get_time", '{"city": "Tokyo"}'), ids=True)
NAMED = {
    "no system, no tools": ([USER], None),
    "system prompt": ([{"role": "system", "content": "Be brief."}, USER], None),
    "named system and user": ([{"role": "system", "name": "ops", "content": "S"},
                               {"role": "user", "name": "bob", "content": "hi"}], None),
    "multi-part content": ([{"role": "user", "content": [{"type": "text", "text": "Weather "},
                                                         {"type": "text", "text": "in Tokyo?"}]},
                            {"role": "assistant", "content": [{"type": "text", "text": "Sunny"},
                                                              {"type": "text", "text": "."}]},
                            {"role": "user", "content": []}], None),
    "empty and missing content": ([USER, {"role": "assistant", "content": ""}, {"role": "user"},
                                   {"role": "assistant", "content": None}, {"role": "user", "content": "ok"}], None),
    "typed and string arguments": ([USER, {"role": "assistant", "content": "Checking.", "tool_calls": TWO_CALLS},
                                    {"role": "tool", "tool_call_id": "call_get_weather_0", "content": "22C"},
                                    {"role": "tool", "tool_call_id": "call_get_time_1", "content": "09:00"}],
                                   [WEATHER, TIME]),
    "named tool results": ([USER, {"role": "assistant", "content": None, "tool_calls": TWO_CALLS},
                            {"role": "tool", "name": "get_weather", "content": "22C"},
                            {"role": "tool", "name": "get_time", "content": "09:00"}], [WEATHER, TIME]),
    "results out of call order": ([USER, {"role": "assistant", "content": "", "tool_calls": TWO_CALLS},
                                   {"role": "tool", "tool_call_id": "call_get_time_1", "content": "09:00"},
                                   {"role": "tool", "tool_call_id": "call_get_weather_0", "content": "22C"}],
                                  [WEATHER, TIME]),
    "several tool rounds": ([
        USER, {"role": "assistant", "content": "", "tool_calls": _calls(("get_weather", {"city": "Tokyo"}))},
        {"role": "tool", "content": "22C"},
        {"role": "assistant", "content": "", "tool_calls": _calls(("get_time", "{}"), ("get_weather", ""))},
        {"role": "tool", "content": "09:00"}, {"role": "tool", "content": "?"},
        {"role": "assistant", "content": "22C at 09:00."}, {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": _calls(("get_weather", '{"city": "Paris"}'))},
        {"role": "tool", "content": "18C"}], [WEATHER, TIME]),
    "non-JSON string arguments": ([USER, {"role": "assistant", "tool_calls": _calls(("get_weather", "{city: Tokyo"))},
                                   {"role": "tool", "content": "?"}], [WEATHER]),
    "tool result answering no call": ([USER, {"role": "tool", "name": "get_weather", "content": "22C"}], [WEATHER]),
    "reasoning carried back": ([USER, {"role": "assistant", "reasoning_content": "Need both.", "content": "",
                                       "tool_calls": TWO_CALLS},
                                {"role": "tool", "tool_call_id": "call_get_weather_0", "content": "22C"},
                                {"role": "tool", "tool_call_id": "call_get_time_1", "content": "09:00"},
                                {"role": "assistant", "reasoning": "Done.", "content": "22C, 09:00."}], [WEATHER]),
    "unicode and markup": ([{"role": "user", "content": '東京の天気は? "quoted" & <|im_end|> <|close|>'}],
                           [{"type": "function", "function": {"name": "天気", "description": "Ünïcode"}}]),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_kimi_linear_named_conversations_match_the_template(kltok, name):
    messages, tools = NAMED[name]
    text = check_kimi_linear(kltok, messages, tools)
    if tools and any(m.get("tool_calls") for m in messages):
        assert "functions.get_weather:0" in text and "call_get" not in text  # the template's ids, never the client's


@pytest.mark.parametrize("effort", ["low", "high", "max"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("name", list(NAMED))
def test_k3_named_conversations_match_the_encoder(k3tok, name, thinking, effort):
    messages, tools = NAMED[name]
    check_k3(k3tok, messages, tools, thinking=thinking, thinking_effort=effort, add_generation_prompt=True)


def test_kimi_linear_ids_and_role_slots():
    """The template's choices spelled out on one conversation: calls named ``functions.{name}:{n}`` counting across
    the conversation whatever their ids, results answering the oldest open call in order whatever their
    ``tool_call_id``, a tool message's role slot its ``name`` (else ``tool``), the default system prompt and its
    newline, tools with sorted keys."""
    messages = NAMED["several tool rounds"][0][:6]
    messages = [*messages[:2], {**messages[2], "name": "get_weather", "tool_call_id": "bogus"}, *messages[3:]]
    text = k2_reference(messages, [WEATHER])
    assert text == render_chat_text(None, messages, tools=[WEATHER], chat_format="kimi_linear")
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"function": {"description": "Get weather", '
                           '"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, '
                           f'"required": ["city"], "type": "object"}}}}, "type": "function"}}]<|im_end|>'
                           f"<|im_system|>system<|im_middle|>{K2_DEFAULT_SYSTEM}<|im_end|>\n<|im_user|>user")
    assert [text.count(f"<|tool_call_begin|>{i}<|tool_call_argument_begin|>")
            for i in ("functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2")] == [1, 1, 1]
    assert "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n22C<|im_end|>" in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n09:00<|im_end|>" in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:2\n?<|im_end|>" in text


def test_k3_string_arguments_follow_the_encoder_not_the_jinja_port(k3tok):
    """A JSON-string ``arguments`` is parsed into typed arguments (Moonshot's encoder), where llama.cpp's Jinja port
    writes the string as a raw json block; render_chat, apply_chat_template and the text agree."""
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": _calls(("get_weather", '{"city": "Tokyo", '
                                                                                 '"days": 2, "hourly": true}'))},
                {"role": "tool", "content": "22C"}]
    text = check_k3(k3tok, messages, [WEATHER], thinking=False, thinking_effort="max", add_generation_prompt=True)
    assert ('<|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|><|open|>argument key="days" '
            'type="number"<|sep|>2<|close|>argument<|sep|><|open|>argument key="hourly" type="boolean"<|sep|>true'
            '<|close|>argument<|sep|>') in text and "json type" not in text
    port = K3_TEMPLATE.render(messages=messages, tools=[WEATHER], thinking=False, add_generation_prompt=True)
    assert '<|open|>json type="object"<|sep|>{"city": "Tokyo", "days": 2, "hourly": true}<|close|>json' in port


def test_k3_keys_sort_case_sensitively_as_the_encoder(k3tok):
    """Tool and schema keys sort as Python sorts them (the encoder's ``deep_sort_dict``): upper case first. The
    Jinja port's ``dictsort`` ignores case, so it differs here."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"b": {"type": "string"}, "Z": {"type": "number"}, "_a": {}, "A": {}}}}}]
    rf = {"type": "json_schema", "json_schema": {"schema": {"properties": {"y": {}, "X": {}}, "type": "object"}}}
    segments = k3_reference([USER], tools, thinking=True, thinking_effort="max", response_format=rf)
    want = "".join(s.text for s in segments)
    assert render_chat_text(k3tok, [USER], tools=tools, response_format=rf) == want
    assert render_chat(k3tok, [USER], tools=tools, response_format=rf) == encoder_ids(segments, k3tok)
    assert '"properties":{"A":{},"Z":{"type":"number"},"_a":{},"b":{"type":"string"}}' in want
    assert '{"properties":{"X":{},"y":{}},"type":"object"}' in want
    assert k3_template([USER], tools, thinking=True, thinking_effort="max", response_format=rf) != want


def test_k3_attribute_pieces_are_encoded_one_by_one(k3tok):
    """Attribute pieces are encoded one by one, as the encoder's segments are: an empty value leaves ``="`` and
    ``"`` apart (encoded as one string they would merge into ``=""``, a token of the fixture's vocabulary)."""
    messages = [USER, {"role": "assistant", "tool_calls": _calls(("get_weather", {"": "x"}))}]
    segments = k3_reference(messages, thinking=False)
    assert 'key=""' in "".join(s.text for s in segments)
    ids = render_chat(k3tok, messages, thinking=False)
    assert ids == encoder_ids(segments, k3tok)
    merged = k3tok.encode("".join(s.text for s in segments), allowed_special="all")
    assert ids != merged  # a renderer that merged the pieces would be wrong here


@pytest.mark.parametrize("arguments", ["[1, 2]", "5", '"text"', "null"])
def test_k3_non_object_json_arguments_are_refused_as_by_the_encoder(k3tok, arguments):
    """A JSON string of anything but an object: the encoder refuses it (ValueError), and so do we, naming it."""
    messages = [USER, {"role": "assistant", "tool_calls": _calls(("get_weather", arguments))}]
    with pytest.raises(ValueError, match="JSON object"):
        k3_reference(messages, thinking=True)
    with pytest.raises(ValueError, match="message 1, tool call 1: tool call arguments must be a JSON object"):
        render_chat(k3tok, messages)


def test_content_shapes_the_templates_do_not_render_are_refused(kltok):
    """Content the templates would drop or garble (a bare string part, a dict instead of a list) is refused with an
    error naming the problem, for both formats."""
    for fmt in ("kimi_linear", "kimi_k3"):
        with pytest.raises(TypeError, match="content part 1 must be a dict"):
            render_chat_text(None, [{"role": "user", "content": [{"text": "a"}, "b"]}], chat_format=fmt)
        with pytest.raises(TypeError, match="content must be str, list or None, got dict"):
            render_chat_text(None, [{"role": "user", "content": {"text": "a"}}], chat_format=fmt)
