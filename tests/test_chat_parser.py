"""Reply parser (kimi_mlx.chat.parser): the spec's observed K3 output, typed arguments, json blocks, a skipped think
closer, truncated streams, garbage (raw content + warning, never an exception), Kimi Linear tool calls, and
streaming (any chunking gives the one-shot result; no half marker is ever shown)."""

import random

import pytest
from xtml_tokenizer import load_xtml_tokenizer

from kimi_mlx.chat.parser import ReplyParser, parse_reply

TURN_END = "<|close|>message<|sep|>"
# spec §3.3: observed greedy output after the thinking prompt, then the well-formed turn end
OBSERVED = "15% of 240 = 0.15 × 240 = 36.<|close|>think<|sep|><|open|>response<|sep|>15% of 240 is 36."
OBSERVED_TURN = OBSERVED + "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"

TYPED_CALL = (
    "Let me look.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>São "Paulo" 42<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="ratio" type="number"<|sep|>-0.5e1<|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"units": "C", "hours": [6, 12]}<|close|>argument<|sep|>'
    '<|open|>argument key="flag" type="boolean"<|sep|>false<|close|>argument<|sep|>'
    '<|open|>argument key="none" type="null"<|sep|>null<|close|>argument<|sep|>'
    '<|open|>argument key="a&quot;b" type="array"<|sep|>[1, "x"]<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
    '<|open|>call tool="search" index="2"<|sep|><|open|>json type="object"<|sep|>{"q": "kimi", "n": {"k": 2}}'
    "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>" + TURN_END
)
TYPED_ARGS = {
    "city": 'São "Paulo" 42',
    "days": 3,
    "ratio": -5.0,
    "opts": {"units": "C", "hours": [6, 12]},
    "flag": False,
    "none": None,
    'a"b': [1, "x"],
}
MARKER_PREFIXES = ("<", "<|", "<|o", "<|open", "<|close|", "<|end_of_m", "<|tool_call", "<|im_e")


def stream(text: str, chat_format: str, sizes=(1,), seed: int = 0, **kw):
    """Feed ``text`` in chunks of random sizes from ``sizes``; returns (events, reply)."""
    rng = random.Random(seed)
    parser = ReplyParser(chat_format, **kw)
    events, i = [], 0
    while i < len(text):
        n = rng.choice(sizes)
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.finish()
    return events, parser.reply


def test_spec_observed_output():
    """The spec's observed output: reasoning (thinking prompt opened think), then content; the full turn is complete
    and clean, the bare prefix is content cut off (a warning, nothing lost)."""
    r = parse_reply(OBSERVED_TURN, "kimi_k3")
    assert (r.reasoning, r.content, r.tool_calls, r.warnings, r.complete) == (
        "15% of 240 = 0.15 × 240 = 36.",
        "15% of 240 is 36.",
        [],
        [],
        True,
    )
    cut = parse_reply(OBSERVED, "kimi_k3")
    assert (cut.reasoning, cut.content, cut.complete) == (r.reasoning, r.content, False)
    assert len(cut.warnings) == 1 and "cut off" in cut.warnings[0]
    # the stop token is usually not in the streamed text: ending at <|close|>message<|sep|> is complete
    assert parse_reply(OBSERVED_TURN.removesuffix("<|end_of_msg|>"), "kimi_k3").complete


def test_typed_arguments_and_json_block():
    """Typed arguments: string raw (quotes and digits kept), number/object/boolean/null/array JSON-decoded, attribute
    values unescaped; a json block gives the object and keeps its raw text."""
    r = parse_reply(TYPED_CALL, "kimi_k3")
    assert not r.warnings and r.complete
    assert (r.reasoning, r.content) == ("Let me look.", "Checking.")
    weather, search = r.tool_calls
    assert weather.name == "get_weather" and weather.index == 1 and weather.arguments == TYPED_ARGS
    assert weather.raw_arguments is None
    assert search.name == "search" and search.index == 2 and search.arguments == {"q": "kimi", "n": {"k": 2}}
    assert search.raw_arguments == '{"q": "kimi", "n": {"k": 2}}'
    assert search.to_dict() == {
        "type": "function",
        "id": "functions.search:2",
        "function": {"name": "search", "arguments": '{"q": "kimi", "n": {"k": 2}}'},
    }


def test_skipped_think_closer():
    """The model may skip <|close|>think<|sep|>: <|open|>response<|sep|> (or <|open|>tools<|sep|>) ends reasoning."""
    r = parse_reply("R1<|open|>response<|sep|>C1<|close|>response<|sep|>" + TURN_END, "kimi_k3")
    assert (r.reasoning, r.content, r.warnings, r.complete) == ("R1", "C1", [], True)
    call = '<|open|>call tool="t" index="1"<|sep|><|close|>call<|sep|>'
    r = parse_reply(f"R2<|open|>tools<|sep|>{call}<|close|>tools<|sep|>" + TURN_END, "kimi_k3")
    assert (r.reasoning, r.content, r.warnings) == ("R2", "", [])
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("t", {})]
    # response closer skipped before the turn end
    r = parse_reply("<|close|>think<|sep|><|open|>response<|sep|>C" + TURN_END, "kimi_k3")
    assert (r.reasoning, r.content, r.warnings, r.complete) == ("", "C", [], True)


def test_thinking_off_starts_in_response():
    """thinking=False (the prompt opened response): text is content from the start."""
    r = parse_reply("Hello<|close|>response<|sep|>" + TURN_END, "kimi_k3", thinking=False)
    assert (r.reasoning, r.content, r.warnings, r.complete) == ("", "Hello", [], True)


@pytest.mark.parametrize(
    ("cut_at", "reasoning", "content", "n_calls"),
    [
        ("Let me lo", "Let me lo", "", 0),  # inside think
        ("Checking.<|clo", "Let me look.", "Checking.<|clo", 0),  # half a marker, flushed as text at the end
        ('<|open|>argument key="days" type="number"<|sep|>3', "Let me look.", "Checking.", 0),  # inside a call
        ('<|open|>call tool="search"', "Let me look.", "Checking.", 1),  # half a tag after one complete call
    ],
    ids=["think", "half_marker", "inside_call", "half_tag"],
)
def test_truncated_stream(cut_at, reasoning, content, n_calls):
    """A stream cut anywhere ends cleanly: text so far in its channel, an unfinished call as raw content (never a
    half-parsed call), a cut-off warning, complete=False."""
    text = TYPED_CALL[: TYPED_CALL.index(cut_at) + len(cut_at)]
    events, r = stream(text, "kimi_k3", sizes=(1, 2, 7))
    assert r.reasoning == reasoning
    assert r.content.startswith(content)
    assert len(r.tool_calls) == n_calls and not r.complete
    assert any("cut off" in w for w in r.warnings)
    assert [e.text for e in events if e.kind == "warning"] == r.warnings
    if cut_at.startswith("<|open|>argument"):
        call_start = text.index('<|open|>call tool="get_weather"')
        assert r.content == "Checking." + text[call_start:]
        assert any("malformed tool call" in w for w in r.warnings)
    if cut_at.startswith("<|open|>call"):
        assert r.content == 'Checking.<|open|>call tool="search"'


@pytest.mark.parametrize(
    ("text", "warning"),
    [
        (
            '<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>{not json<|close|>json<|sep|><|close|>call<|sep|>',
            "not valid JSON",
        ),
        (
            '<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|>',
            "not a JSON object",
        ),
        ('<|open|>call index="1"<|sep|><|close|>call<|sep|>', "no tool name"),
        ('<|open|>call tool="f"<|sep|>junk<|close|>call<|sep|>', "unexpected text"),
        (
            '<|open|>call tool="f"<|sep|><|open|>argument type="string"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|>',
            "without a key",
        ),
    ],
    ids=["bad_json", "json_not_object", "no_name", "junk", "no_key"],
)
def test_malformed_tool_call_is_raw_content(text, warning):
    """A malformed call inside the tools section is kept verbatim as content with a warning; parsing goes on."""
    full = f"R<|close|>think<|sep|><|open|>tools<|sep|>{text}<|close|>tools<|sep|>" + TURN_END
    r = parse_reply(full, "kimi_k3")
    assert r.tool_calls == [] and r.reasoning == "R" and r.complete
    assert r.content == text
    assert any(warning in w for w in r.warnings), r.warnings


@pytest.mark.parametrize("chat_format, text", [
    ("kimi_k3", '<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>{DEEP}<|close|>json<|sep|><|close|>call<|sep|>'),
    ("kimi_k3", '<|open|>call tool="f"<|sep|><|open|>argument key="a" type="array"<|sep|>{DEEP}<|close|>argument<|sep|>'
                '<|close|>call<|sep|>'),
    ("kimi_linear", "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{DEEP}<|tool_call_end|>"),
], ids=["k3_json_block", "k3_argument", "kimi_linear"])
def test_deeply_nested_arguments_never_raise(chat_format, text):
    """Tool-call JSON nested 100,000 deep (past Python's recursion limit) is invalid JSON like any other: no call,
    a warning, parsing goes on (a model can write it; it must not end the reply with a RecursionError)."""
    deep = "[" * 100_000 + "]" * 100_000
    text = text.replace("{DEEP}", deep)
    if chat_format == "kimi_k3":
        full = f"R<|close|>think<|sep|><|open|>tools<|sep|>{text}<|close|>tools<|sep|>" + TURN_END
    else:
        full = f"<|tool_calls_section_begin|>{text}<|tool_calls_section_end|>"
    r = parse_reply(full, chat_format)
    if "argument key" in text:  # a typed argument that is not JSON is kept as a string, with a warning
        assert [c.arguments for c in r.tool_calls] == [{"a": deep}]
        assert any("is not JSON; kept as a string" in w for w in r.warnings), r.warnings
    else:  # a call whose arguments are not JSON is kept as raw content, with a warning
        assert r.tool_calls == [] and deep in r.content
        assert any("not valid JSON (nested too deeply to decode)" in w for w in r.warnings), r.warnings


def test_garbage_never_raises():
    """Garbage: unknown tags, stray markers, text after the end — raw content (or reasoning) + warnings."""
    r = parse_reply("x<|open|>bogus<|sep|>y<|close|>think<|sep|>z<|open|>blah <|open|>response<|sep|>c", "kimi_k3")
    assert r.reasoning == "x<|open|>bogus<|sep|>y"
    assert r.content == "z<|open|>blahc"  # whitespace before a section marker is dropped
    assert any("bogus" in w for w in r.warnings) and any("without a closing" in w for w in r.warnings)
    r = parse_reply(OBSERVED_TURN + "more", "kimi_k3")
    assert r.content == "15% of 240 is 36.more" and any("after the end" in w for w in r.warnings)
    typed_bad = (
        '<|open|>tools<|sep|><|open|>call tool="f"<|sep|><|open|>argument key="n" type="number"<|sep|>ten'
        '<|close|>argument<|sep|><|open|>argument key="u" type="weird"<|sep|>1<|close|>argument<|sep|>'
        '<|open|>argument key="b" type="boolean"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>'
    )
    r = parse_reply(typed_bad, "kimi_k3", thinking=False)
    assert r.tool_calls[0].arguments == {"n": "ten", "u": "1", "b": 1}
    assert len(r.warnings) == 4  # not JSON, unknown type, type mismatch, cut off
    rng = random.Random(1)
    pieces = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "tools", 'call tool="x"',
              "argument", 'key="k"', "json", "message", " ", "txt", "{", "}", "<", "|", '"', "<|"]  # fmt: skip
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        for thinking in (True, False):
            whole = parse_reply(text, "kimi_k3", thinking=thinking)
            _, streamed = stream(text, "kimi_k3", sizes=(1, 3, 8), seed=len(text), thinking=thinking)
            assert streamed == whole, text
    kl_pieces = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "functions.f:0",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>", '{"a": 1}', " ", "x", "<", "<|"]  # fmt: skip
    for _ in range(300):
        text = "".join(rng.choice(kl_pieces) for _ in range(rng.randint(0, 30)))
        _, streamed = stream(text, "kimi_linear", sizes=(1, 4, 9), seed=len(text))
        assert streamed == parse_reply(text, "kimi_linear"), text


@pytest.mark.parametrize("sizes", [(1,), (2, 5), (64,)], ids=["char", "mixed", "large"])
def test_streaming_matches_one_shot_and_hides_half_markers(sizes):
    """Any chunking yields the one-shot reply; deltas concatenate to the channels; no event text contains a marker or
    ends in a marker prefix; tool calls are emitted only when their closer arrives, in order."""
    events, r = stream(TYPED_CALL, "kimi_k3", sizes=sizes)
    assert r == parse_reply(TYPED_CALL, "kimi_k3")
    assert "".join(e.text for e in events if e.kind == "reasoning") == r.reasoning
    assert "".join(e.text for e in events if e.kind == "content") == r.content
    assert [e.tool_call.name for e in events if e.kind == "tool_call"] == ["get_weather", "search"]
    for e in events:
        assert "<|" not in e.text and not e.text.endswith(MARKER_PREFIXES)
    parser = ReplyParser("kimi_k3")
    head = TYPED_CALL[: TYPED_CALL.index("<|close|>call<|sep|>")]
    assert not [e for e in parser.feed(head) if e.kind == "tool_call"]
    assert [e.kind for e in parser.feed("<|close|>call<|sep|>")] == ["tool_call"]


def test_detokenized_token_stream(tmp_path):
    """Token by token through the XTML tokenizer's streaming detokenizer (markers arrive as single special tokens)."""
    tok = load_xtml_tokenizer(tmp_path)
    ids = tok.encode(TYPED_CALL + "<|end_of_msg|>", allowed_special="all")
    det, parser, events = tok.detokenizer, ReplyParser("kimi_k3"), []
    for t in ids:
        det.add_token(t)
        events += parser.feed(det.last_segment)
    det.finalize()
    events += parser.feed(det.last_segment) + parser.finish()
    assert parser.reply.tool_calls[0].arguments == TYPED_ARGS and not parser.reply.warnings
    assert parser.reply.complete


KL_CALLS = (
    "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Tokyo"}<|tool_call_end|><|tool_call_begin|> functions.add:1 <|tool_call_argument_begin|>{"a": 2, "b": 3}'
    "<|tool_call_end|><|tool_calls_section_end|>"
)


def test_kimi_linear_tool_calls():
    """Kimi Linear: content, then the tool-call section (ids functions.NAME:IDX, JSON args); any chunking."""
    r = parse_reply(KL_CALLS, "kimi_linear")
    assert (r.reasoning, r.content, r.warnings, r.complete) == ("", "Sure.", [], True)
    assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Tokyo"}),
        ("functions.add:1", "add", {"a": 2, "b": 3}),
    ]
    for sizes in ((1,), (3, 11)):
        events, streamed = stream(KL_CALLS, "kimi_linear", sizes=sizes)
        assert streamed == r
        assert "".join(e.text for e in events if e.kind == "content") == "Sure."
    plain = parse_reply("Just text <|im_start|> kept.<|im_end|>", "kimi_linear")
    assert (plain.content, plain.warnings, plain.complete) == ("Just text <|im_start|> kept.", [], True)


def test_kimi_linear_malformed_and_truncated():
    """Kimi Linear: bad JSON arguments -> raw content + warning; a cut-off call -> raw content + cut-off warning."""
    bad = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops<|tool_call_end|><|tool_calls_section_end|>"
    r = parse_reply(bad, "kimi_linear")
    assert r.tool_calls == [] and r.content == bad.removeprefix("<|tool_calls_section_begin|>").removesuffix(
        "<|tool_calls_section_end|>"
    )
    assert any("not valid JSON" in w for w in r.warnings)
    cut = KL_CALLS[: KL_CALLS.index('{"a": 2')]
    r = parse_reply(cut, "kimi_linear")
    assert [c.name for c in r.tool_calls] == ["get_weather"] and not r.complete
    assert r.content.endswith("functions.add:1 <|tool_call_argument_begin|>")
    assert any("cut off" in w for w in r.warnings)
    r = parse_reply("a<|tool_calls_section_end|>b<|im_end|>c", "kimi_linear")
    assert r.content == "a<|tool_calls_section_end|>bc" and len(r.warnings) == 2


def test_parser_argument_errors():
    """Programming errors (not model output) raise: unknown format, thinking for Kimi Linear, feed after finish."""
    with pytest.raises(ValueError, match="chat_format='chatml'"):
        ReplyParser("chatml")
    with pytest.raises(ValueError, match="Kimi Linear"):
        ReplyParser("kimi_linear", thinking=True)
    p = ReplyParser("kimi_k3")
    p.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")
