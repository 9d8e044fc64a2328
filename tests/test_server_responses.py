"""The OpenAI Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``) of a real ``kimi-mlx
serve`` process, driven by the official ``openai`` client (``responses.create`` and ``responses.stream``, whose
event parser refuses events out of order). Expected values come from the server's own Chat Completions route for
the same conversation (greedy): the same text and token counts, whole and streamed; function-call round trips
(items in the input on the demo model and on the Kimi-K3 fixture, a forced tool_choice), K3 reasoning items,
structured replies (``text.format`` as chat's ``response_format``), images (the K3 vision fixture: ``input_image``
as chat's ``image_url``); ``previous_response_id`` equal to sending the whole conversation, with the prefix cache
supplying the shared tokens; stored responses and the store's byte budget; malformed requests getting OpenAI's
error shape and a 4xx while the server keeps serving. The stream events of an output with every item kind
(reasoning, text, function calls) go through the client's own event accumulator.
"""

import base64
import json
import time

import httpx2 as httpx
import openai
import pytest
from conftest import K3_FIXTURE, SHARED
from serve_helpers import Server
from xtml_tokenizer import write_xtml_tokenizer_dir

from kimi_mlx.server.response_store import ResponseStore

N = 12
TOOL = {"type": "function", "name": "get_weather", "description": "Get weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", "demo", "--max-tokens", str(N)]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def chat(oai, messages, **kw):
    return oai.chat.completions.create(model=kw.pop("model", "demo"), messages=messages, temperature=0,
                                       max_tokens=N, **kw)


def status_of(chat_reply) -> str:
    return "incomplete" if chat_reply.choices[0].finish_reason == "length" else "completed"


def test_create_equals_chat(oai):
    c = chat(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    r = oai.responses.create(model="demo", instructions="Be brief.", input="Hello there", temperature=0,
                             max_output_tokens=N)
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.status == status_of(c) and r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_message_items_equal_a_string(oai):
    """Developer and user message items with input_text parts render as the chat route's system and user
    messages."""
    c = chat(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    r = oai.responses.create(model="demo", temperature=0, max_output_tokens=N, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                        {"type": "input_text", "text": "there"}]}])
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_stream_event_sequence(oai):
    c = chat(oai, [{"role": "user", "content": "Tell me a story"}])
    with oai.responses.stream(model="demo", input="Tell me a story", temperature=0, max_output_tokens=N) as s:
        events = list(s)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == c.choices[0].message.content and len(deltas) > 1
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == EVENT_ORDER + [f"response.{status_of(c)}"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == c.choices[0].message.content
    final = events[-1].response
    assert final.output[0].content[0].text == done.text and final.usage.output_tokens == c.usage.completion_tokens
    item = next(e for e in events if e.type == "response.output_item.done").item
    assert item.id == events[2].item.id and item.status == final.status


def test_function_call_output_items_equal_chat_tool_messages(oai):
    """A function_call and its function_call_output in the input render as the chat route's assistant tool call
    and tool message: the same greedy text from the same prompt."""
    args = json.dumps({"city": "Paris"})
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    c = chat(oai, messages, tools=[CHAT_TOOL])
    r = oai.responses.create(model="demo", temperature=0, max_output_tokens=N, tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.tools[0].name == "get_weather"


def test_previous_response_id_equals_the_whole_conversation(oai):
    first = oai.responses.create(model="demo", input="Hello there", temperature=0, max_output_tokens=N)
    follow = oai.responses.create(model="demo", input="And again?", previous_response_id=first.id, temperature=0,
                                  max_output_tokens=N)
    whole = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And again?"}]
    c = chat(oai, whole)
    assert follow.output_text == c.choices[0].message.content
    assert follow.usage.input_tokens == c.usage.prompt_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert follow.previous_response_id == first.id
    by_items = oai.responses.create(model="demo", input=whole, temperature=0, max_output_tokens=N, store=False)
    assert by_items.output_text == follow.output_text


def test_stored_responses_get_delete_and_store_false(oai):
    r = oai.responses.create(model="demo", input="Hi", temperature=0, max_output_tokens=4)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.output_tokens == r.usage.output_tokens
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="demo", input="Hi", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    unkept = oai.responses.create(model="demo", input="Hi", temperature=0, max_output_tokens=4, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unkept.id)


def test_stream_stores_the_response(oai):
    with oai.responses.stream(model="demo", input="Hi", temperature=0, max_output_tokens=4) as s:
        final = list(s)[-1].response
    assert oai.responses.retrieve(final.id).output_text == final.output[0].content[0].text


def test_store_budget_evicts_least_recently_used():
    items = [{"type": "message", "role": "user", "content": "x" * 100}]
    one = ResponseStore(0)
    size = len(json.dumps({"id": "a"})) + len(json.dumps(items))
    store = ResponseStore(2 * size)
    assert store.put({"id": "a"}, items) and store.put({"id": "b"}, items) and store.used == 2 * size
    assert store.get("a") is not None  # a is now the most recently used: c evicts b
    assert store.put({"id": "c"}, items)
    assert store.get("b") is None and store.get("a").items == tuple(items) and len(store) == 2
    assert not one.put({"id": "a"}, items) and len(one) == 0
    assert store.delete("a") and not store.delete("a") and store.used == size


IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJR"
         "U5ErkJggg==")
BAD = [
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, 400, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]}, 400, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}]}, 400,
     "input[0].content[0]"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**9}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": "hi", "stream": "yes"}, 400, "stream"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_malformed_requests(server, body, status, param):
    r = httpx.post(server.url + "/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] and err["message"], err


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_leaving_stops_the_generation(server, oai, stream):
    """A client that goes away (a stream closed after its first delta, or a whole reply given up on): its
    generation stops well before its 20000 tokens (greedy demo text runs on without an end): one log line that says
    so."""
    before = server.log().count("POST /v1/responses |")
    body = {"model": "demo", "input": "Tell me a long story", "max_output_tokens": 20000, "temperature": 0}
    if stream:
        with oai.responses.stream(**body) as s:
            next(e for e in s if e.type == "response.output_text.delta")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/responses", json=body, timeout=httpx.Timeout(30, read=0.5))
    for _ in range(100):
        stats = httpx.get(server.base + "/health").json()["stats"]
        if stats["running"] == 0 and stats["prefilling"] == 0:
            break
        time.sleep(0.05)
    assert stats["running"] == 0, stats
    lines = [line for line in server.log().splitlines() if "POST /v1/responses |" in line][before:]
    assert len(lines) == 1 and lines[0].endswith(("client disconnected", "cancelled")), lines
    assert int(lines[0].split("generated ")[1].split(" tok")[0]) < 20000


def test_still_serving(server, oai):
    assert httpx.post(server.url + "/responses", content=b"{not json", timeout=30).status_code == 400
    assert httpx.get(server.url + "/responses/resp_nope", timeout=30).status_code == 404
    assert oai.responses.create(model="demo", input="Hi", max_output_tokens=2).usage.output_tokens > 0
    assert "Traceback" not in server.log()


# ------------------------------------------------------------------------------------------------------- Kimi-K3


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    model_dir = write_xtml_tokenizer_dir(tmp_path_factory.mktemp("k3"))
    (model_dir / "model.safetensors").symlink_to(K3_FIXTURE / "hf" / "model.safetensors")
    flags = ["--model", str(model_dir), "--served-model-name", "k3", "--max-tokens", str(N)]
    with Server(flags, tmp_path_factory.mktemp("serve-k3"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)


def test_k3_reasoning_item(k3):
    c = chat(k3, [{"role": "user", "content": "Is 123 a prime?"}], model="k3", reasoning_effort="high")
    r = k3.responses.create(model="k3", input="Is 123 a prime?", reasoning={"effort": "high"}, temperature=0,
                            max_output_tokens=N)
    reasoning = c.choices[0].message.reasoning_content
    assert reasoning and r.output[0].type == "reasoning"
    assert r.output[0].content[0].text == reasoning and r.output[0].summary == []
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.usage.output_tokens == c.usage.completion_tokens
    assert r.reasoning.effort == "high"
    with k3.responses.stream(model="k3", input="Is 123 a prime?", reasoning={"effort": "high"}, temperature=0,
                             max_output_tokens=N) as s:
        events = list(s)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert events[2].type == "response.output_item.added" and events[2].item.type == "reasoning"


def test_k3_forced_tool_choice_equals_chat(k3):
    """tool_choice naming a function renders as the chat route's: the same prompt and reply (the fixture's random
    weights need not write a parseable call; whatever it writes comes back alike)."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    c = chat(k3, user, model="k3", tools=[CHAT_TOOL], reasoning_effort="none",
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = k3.responses.create(model="k3", input=user, tools=[TOOL], reasoning={"effort": "none"}, temperature=0,
                            max_output_tokens=N, tool_choice={"type": "function", "name": "get_weather"})
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.output_text == (c.choices[0].message.content or "")
    calls = [(i.name, i.call_id, i.arguments) for i in r.output if i.type == "function_call"]
    assert calls == [(t.function.name, t.id, t.function.arguments) for t in c.choices[0].message.tool_calls or []]


def test_k3_function_call_round_trip(k3):
    """A reasoning item, a function_call and its function_call_output render as the chat route's assistant turn
    (reasoning_content, tool call) and tool message; continuing it with previous_response_id gives the same."""
    args = json.dumps({"city": "Tokyo"})
    user = [{"role": "user", "content": "Weather in Tokyo?"}]
    messages = user + [
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22C sunny"}]
    c = chat(k3, messages, model="k3", tools=[CHAT_TOOL])
    items = user + [
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "22C sunny"}]
    r = k3.responses.create(model="k3", input=items, tools=[TOOL], temperature=0, max_output_tokens=N)
    message = c.choices[0].message
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.output_text == (message.content or "")
    reasoning = [i.content[0].text for i in r.output if i.type == "reasoning"]
    assert reasoning == ([message.reasoning_content] if message.reasoning_content else [])
    follow = k3.responses.create(model="k3", input="Thanks", previous_response_id=r.id, tools=[TOOL],
                                 temperature=0, max_output_tokens=N)
    whole = k3.responses.create(model="k3", input=items + [i.model_dump(exclude_none=True) for i in r.output]
                                + [{"role": "user", "content": "Thanks"}], tools=[TOOL], temperature=0,
                                max_output_tokens=N, store=False)
    assert follow.output_text == whole.output_text and follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_k3_text_format_equals_response_format(k3):
    """text.format json_schema renders as the chat route's response_format: the same reply."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    user = [{"role": "user", "content": "Is 123 a prime?"}]
    c = chat(k3, user, model="k3", reasoning_effort="none",
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    plain = k3.responses.create(model="k3", input=user, reasoning={"effort": "none"}, temperature=0,
                                max_output_tokens=N)
    r = k3.responses.create(model="k3", input=user, reasoning={"effort": "none"}, temperature=0, max_output_tokens=N,
                            text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert r.usage.input_tokens == c.usage.prompt_tokens > plain.usage.input_tokens
    assert r.output_text == (c.choices[0].message.content or "")
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema


# ------------------------------------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def k3v(tmp_path_factory):
    flags = ["--model", str(SHARED / "fixtures" / "k3_vision" / "k3-vl-tiny"), "--served-model-name", "k3v",
             "--dtype", "float32", "--max-tokens", str(N)]
    with Server(flags, tmp_path_factory.mktemp("serve-k3v"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)


def test_input_image_equals_chat_image_url(k3v):
    """An input_image part (a data: URL) reaches the model as the chat route's image_url part does: the same
    reply and prompt tokens (the image's placeholders included); a bad image names its part."""
    png = SHARED / "fixtures" / "k3_vision" / "images" / "img0_rgb_224x168.png"
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    c = chat(k3v, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": "Describe this image."}]}], model="k3v")
    r = k3v.responses.create(model="k3v", temperature=0, max_output_tokens=N, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                     {"type": "input_text", "text": "Describe this image."}]}])
    assert c.usage.prompt_tokens_details.image_tokens > 0
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.output_text == (c.choices[0].message.content or "")
    assert [i.content[0].text for i in r.output if i.type == "reasoning"] == \
        ([c.choices[0].message.reasoning_content] if c.choices[0].message.reasoning_content else [])
    with pytest.raises(openai.BadRequestError) as e:
        k3v.responses.create(model="k3v", max_output_tokens=N, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert e.value.body["param"] == "input[0].content[1]"


# ------------------------------------------------------------------------------------------------------- events


class _Finished:
    """A generation already done: its pieces and counts (what ``_events`` reads of a ``Generation``)."""

    def __init__(self, pieces, reason="stop"):
        self.pieces, self.reason = pieces, reason
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = 9, len(pieces), 4

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece


def test_every_item_kind_streams_through_the_clients_accumulator():
    """Reasoning, text and two function calls streamed: the official client's accumulator takes every event in
    order and its final response holds the items the events built, equal to the response object."""
    import asyncio

    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from kimi_mlx.chat.parser import ReplyEvent, ToolCall
    from kimi_mlx.server.generation import Piece
    from kimi_mlx.server.responses_routes import _events, _Turn
    from kimi_mlx.server.schemas import ResponsesRequest, parse

    tok = object()
    pieces = [Piece(tok, events=[ReplyEvent("reasoning", "Need ")]),
              Piece(tok, events=[ReplyEvent("reasoning", "it.")]),
              Piece(tok, events=[ReplyEvent("content", "Checking")]),
              Piece(tok, events=[
                  ReplyEvent("tool_call", tool_call=ToolCall("get_weather", {"city": "Paris"},
                                                             "functions.get_weather:0")),
                  ReplyEvent("tool_call", tool_call=ToolCall("get_weather", {}, "functions.get_weather:1",
                                                             raw_arguments='{"city": "Rome"}'))]),
              Piece(None)]
    req = parse(ResponsesRequest, json.dumps({"input": "Weather?", "tools": [TOOL]}).encode())
    store = ResponseStore(1 << 20)
    turn = _Turn(req, req.input, "demo", store)

    async def run():
        return [chunk async for chunk in _events(turn, _Finished(pieces), 60)]

    state = ResponseStreamState(input_tools=[TOOL], text_format=openai.omit)
    events = []
    for chunk in asyncio.run(run()):
        name, data = chunk.split("\n")[:2]
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events += state.handle_event(construct_type(type_=ResponseStreamEvent, value=payload))
    final = state._completed_response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Need it." and final.output_text == "Checking"
    calls = [(i.call_id, i.name, json.loads(i.arguments)) for i in final.output[2:]]
    assert calls == [("functions.get_weather:0", "get_weather", {"city": "Paris"}),
                     ("functions.get_weather:1", "get_weather", {"city": "Rome"})]
    assert [e.type for e in events if "function_call_arguments" in e.type] == \
        ["response.function_call_arguments.delta", "response.function_call_arguments.done"] * 2
    built = [e.snapshot for e in events if e.type in ("response.output_text.delta",
                                                      "response.function_call_arguments.delta")]
    assert built == ["Checking", '{"city": "Paris"}', '{"city": "Rome"}']  # the client's sums of the deltas
    kept = store.get(final.id)
    assert kept.response["status"] == final.status == "completed" and len(kept.response["output"]) == 4
    assert kept.items[-2:] == ({"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
                                "arguments": '{"city": "Paris"}'},
                               {"type": "function_call", "call_id": "functions.get_weather:1", "name": "get_weather",
                                "arguments": '{"city": "Rome"}'})
    assert final.usage.output_tokens_details.reasoning_tokens == 2
