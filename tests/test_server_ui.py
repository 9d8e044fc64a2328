"""The chat page at ``/`` in a real browser (Debian's ``chromium`` driven by Playwright, ``KIMI_MLX_CHROMIUM`` to use
another binary) against real ``kimi-mlx serve`` processes: the demo model (a streamed reply equal to the Chat
Completions route's greedy text for the same conversation, stop mid-stream cancelling the request on the server,
edit and regenerate resuming from the prefix cache, branch / rename / export / delete, reload, a narrow window),
``--api-key`` (works with the key, a clear error with a wrong one), ``--no-ui``, and the K3 vision fixture (reasoning
collapsed, an attached image reaching the model). Expected text: the official ``openai`` client's greedy reply on the
same server. Screenshots of each state go to ``KIMI_MLX_UI_SCREENSHOTS`` (default: a temporary folder).
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from conftest import SHARED
from playwright.sync_api import expect, sync_playwright
from serve_helpers import Server

from kimi_mlx.server.errors import GENERATION_FAILED, ApiError

N = 12
SYSTEM = "Be brief."
KEY = "s3cret-key"
VL = SHARED / "fixtures" / "k3_vision"
IMG0 = VL / "images" / "img0_rgb_224x168.png"
SLOW = 60_000  # ms: the machine may be busy (2 shared cores); waits end as soon as their condition holds
expect.set_options(timeout=SLOW)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("KIMI_MLX_UI_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    path = os.environ.get("KIMI_MLX_CHROMIUM") or shutil.which("chromium")
    assert path, "chromium not found: apt-get install chromium (or set KIMI_MLX_CHROMIUM)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


def _server(tmp_path_factory, flags):
    return Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    with _server(tmp_path_factory, ["--model", "demo", "--max-tokens", str(N)]) as s:
        yield s


@pytest.fixture(scope="module")
def page(browser, demo):
    """One page on the demo server for the tests below, in order (they continue one conversation)."""
    context = browser.new_context(accept_downloads=True)
    pg = _open(context, demo)
    yield pg
    context.close()


def _open(context, server):
    """A page on ``server``, checked to raise no script errors, its status loaded (or the key form shown)."""
    pg = context.new_page()
    pg.set_default_timeout(SLOW)
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.goto(server.base + "/")
    pg.wait_for_function("document.querySelector('#status-list dd') || !document.querySelector('#key-form').hidden")
    return pg


def _settings(pg, **values):
    """Set the page's settings (opening the panel with its button)."""
    if pg.locator("#settings").is_hidden():
        pg.click("#toggle-settings")
    for name, value in values.items():
        pg.fill(f"#set-{name.replace('_', '-')}", str(value))
        pg.dispatch_event(f"#set-{name.replace('_', '-')}", "change")


def _wait_reply(pg, index=None):
    """The last assistant message once its stats are shown (or the one at ``index``)."""
    sel = f".msg[data-index='{index}']" if index is not None else ".msg.assistant >> nth=-1"
    node = pg.locator(sel)
    expect(node.locator(".stats")).to_be_visible(timeout=2 * SLOW)
    return node


def _stored(pg) -> dict:
    """The current conversation as the page keeps it in localStorage."""
    convs = pg.evaluate("JSON.parse(localStorage.getItem('kimi-mlx.conversations'))")
    current = pg.evaluate("JSON.parse(localStorage.getItem('kimi-mlx.current'))")
    return next(c for c in convs if c["id"] == current)


def _stats(node) -> dict:
    """The prompt / cached / generated token counts a reply's stats line shows."""
    text = node.locator(".stats").inner_text()
    m = re.search(r"prompt (\d+) tok · cached (\d+) · generated (\d+)", text)
    assert m, text
    return {"prompt": int(m[1]), "cached": int(m[2]), "generated": int(m[3])}


def _greedy(server, messages, max_tokens=N, key="none", **kw):
    """The Chat Completions route's greedy reply (the official client) for ``messages``."""
    client = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
    model = httpx.get(server.base + "/health").json()["model"]
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **kw)


def _health(server) -> dict:
    return httpx.get(server.base + "/health").json()["stats"]


def test_status_route(demo):
    s = httpx.get(demo.url + "/status").json()
    assert (s["model"], s["chat_format"], s["k3"], s["images"], s["ranks"]) == ("demo", "kimi_linear", False, False, 1)
    assert s["weights_bytes"] > 0 and s["memory"]["active_bytes"] > 0 and s["defaults"]["max_tokens"] == N
    assert s["stats"].keys() == _health(demo).keys() and "text-only" in s["no_images"]


def test_send_streams_the_greedy_reply(page, demo, shots):
    """Enter sends, Shift+Enter is a newline; the streamed reply is the API's greedy text; the stats are the
    usage's; the status panel shows the model; the text-only model refuses attachments."""
    _settings(page, system=SYSTEM, temperature=0, max_tokens=N)
    page.click("#toggle-settings")
    page.focus("#input")
    page.keyboard.type("Hello")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("there")
    page.keyboard.press("Enter")
    node = _wait_reply(page)
    conv = _stored(page)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][0]["content"] == "Hello\nthere"
    want = _greedy(demo, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello\nthere"}])
    assert conv["messages"][1]["content"] == want.choices[0].message.content
    assert _stats(node) == {"prompt": want.usage.prompt_tokens, "cached": 0, "generated": want.usage.completion_tokens}
    assert "first token" in node.locator(".stats").inner_text() and "tok/s" in node.locator(".stats").inner_text()
    page.click("#toggle-status")
    expect(page.locator("#status-list dd[data-key='Chat format']")).to_have_text("kimi_linear")
    expect(page.locator("#status-list dd[data-key='Prefix cache']")).to_contain_text("entries")
    expect(page.locator("#images-note")).to_contain_text("text-only")
    assert page.locator("#image-input").is_disabled()
    page.screenshot(path=shots / "01-reply-and-status.png")
    page.click("#toggle-status")
    assert page.errors == []


def test_stop_cancels_the_request(page, demo, shots):
    """Stop mid-stream: the fetch is aborted, the server logs the disconnect and frees the slot."""
    _settings(page, max_tokens=20000)
    page.fill("#input", "Tell me a long story")
    page.keyboard.press("Enter")
    page.wait_for_function("(document.querySelector('.msg.assistant:last-child .body') || {}).textContent?.length > 20")
    page.screenshot(path=shots / "02-streaming.png")
    expect(page.locator("#stop")).to_be_focused()
    page.keyboard.press("Enter")  # the focused Stop button
    expect(page.locator(".msg.assistant >> nth=-1").locator(".muted")).to_have_text("stopped")
    deadline = time.monotonic() + SLOW / 1000
    while time.monotonic() < deadline and "client disconnected" not in demo.log():
        time.sleep(0.1)
    assert "client disconnected" in demo.log(), demo.log()[-2000:]
    line = next(line for line in demo.log().splitlines() if "client disconnected" in line)
    assert int(re.search(r"generated (\d+) tok", line)[1]) < 20000
    stats = _health(demo)
    assert (stats["running"], stats["prefilling"], stats["queued"]) == (0, 0, 0)
    page.screenshot(path=shots / "03-stopped.png")


def test_edit_first_message_and_regenerate(page, demo, shots):
    """Editing the first message drops what follows it; the new reply resumes from the system prompt's cache entry
    (its stats show cached tokens) and is the API's greedy text."""
    _settings(page, max_tokens=N)
    page.click("#toggle-settings")
    first = page.locator(".msg[data-index='0']")
    first.get_by_role("button", name="Edit").click()
    box = first.locator("textarea")
    box.fill("Hello again")
    box.press("Enter")
    node = _wait_reply(page, 1)
    conv = _stored(page)
    assert [m["content"] for m in conv["messages"] if m["role"] == "user"] == ["Hello again"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello again"}]
    stats = _stats(node)
    want = _greedy(demo, messages)
    assert conv["messages"][1]["content"] == want.choices[0].message.content
    assert 0 < stats["cached"] < stats["prompt"] == want.usage.prompt_tokens
    assert f"{stats['prompt']} tok, {stats['cached']} cached" in demo.log()  # the server's own count
    page.screenshot(path=shots / "04-edited-and-regenerated.png")


def test_regenerate_and_branch(page, demo):
    """Regenerate replaces the last reply (greedy: the same text, now all cached); Branch copies the conversation."""
    before, old = _stored(page), _stats(page.locator(".msg[data-index='1']"))
    page.locator(".msg[data-index='1']").get_by_role("button", name="Regenerate").click()
    node = _wait_reply(page, 1)
    after = _stored(page)
    assert after["messages"][1]["content"] == before["messages"][1]["content"]
    stats = _stats(node)
    assert old["cached"] < stats["cached"] < stats["prompt"] == old["prompt"]  # this prompt was seen before
    page.locator(".msg[data-index='0']").get_by_role("button", name="Branch").click()
    branch = _stored(page)
    assert branch["id"] != after["id"] and branch["title"].endswith("(branch)")
    assert branch["messages"] == after["messages"][:1]


def test_rename_export_delete_and_reload(page, demo, shots):
    """Rename by keyboard, export as JSON (the stored conversation), delete the branch; after a reload the
    conversation is listed and opens with its messages."""
    page.on("dialog", lambda d: d.accept())
    items = page.locator("#conversations li")
    expect(items).to_have_count(2)
    items.nth(1).get_by_role("button", name="Rename").click()
    page.keyboard.press("Control+a")
    page.keyboard.type("Greetings")
    page.keyboard.press("Enter")
    expect(items.nth(1).locator(".open")).to_have_text("Greetings")
    items.nth(1).locator(".open").click()
    with page.expect_download() as dl:
        items.nth(1).get_by_role("button", name="Export").click()
    exported = json.loads(Path(dl.value.path()).read_text())
    assert exported == _stored(page) and exported["title"] == "Greetings"
    items.nth(0).get_by_role("button", name="Delete").click()
    expect(items).to_have_count(1)
    page.reload()
    expect(page.locator("#conversations li .open")).to_have_text(["Greetings"])
    page.locator("#conversations li .open").click()
    expect(page.locator(".msg.user .body")).to_have_text(["Hello again"])
    assert page.locator(".msg.assistant .body").inner_text().strip() != ""
    page.screenshot(path=shots / "05-after-reload.png")


def _sse(*events) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _chunk(delta, finish=None):
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "demo",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_tool_calls_and_errors(browser, demo, shots):
    """A refused request (the real server's 400) and an error inside a stream show as errors; a streamed tool call
    (OpenAI's chunk shape: the arguments in pieces) shows as a call."""
    context = browser.new_context()
    pg = _open(context, demo)
    _settings(pg, max_tokens=2_000_000)
    pg.fill("#input", "Hi")
    pg.keyboard.press("Enter")
    expect(pg.locator(".msg.assistant .error")).to_contain_text("HTTP 400")
    expect(pg.locator(".msg.assistant .error")).to_contain_text("context limit")
    _settings(pg, max_tokens=N)
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    replies = [_sse(_chunk({"role": "assistant", "content": ""}), _chunk({"tool_calls": [call]}),
                    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Tokyo"}'}}]}),
                    _chunk({}, "tool_calls")),
               _sse(_chunk({"content": "par"}), ApiError(500, GENERATION_FAILED).openai_body())]
    sent = []

    def reply(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=replies.pop(0))

    pg.route("**/v1/chat/completions", reply)
    pg.locator(".msg[data-index='1']").get_by_role("button", name="Regenerate").click()
    expect(pg.locator(".msg[data-index='1'] .tool-call")).to_have_text('call get_weather({"city": "Tokyo"})')
    pg.fill("#input", "And?")
    pg.keyboard.press("Enter")
    last = pg.locator(".msg[data-index='3']")
    expect(last.locator(".error")).to_have_text(GENERATION_FAILED)
    expect(last.locator(".body")).to_have_text("par")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    history = sent[1]["messages"][:4]
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "(not run: the chat page runs no tools)"}
    assert history[1:3] == [{"role": "assistant", "content": "", "tool_calls": [call]}, answer]
    pg.unroute("**/v1/chat/completions")
    r = httpx.post(demo.url + "/chat/completions", json={**sent[1], "stream": False, "max_tokens": 2})
    assert r.status_code == 200, r.text  # the server takes the page's conversation with a call in it
    pg.screenshot(path=shots / "13-tool-call-and-errors.png")
    assert pg.errors == []
    context.close()


def test_markdown_is_rendered_safely(page):
    """Model text is Markdown: code blocks, inline code, emphasis, lists and http(s) links; HTML and script links
    stay text."""
    html = page.evaluate("renderMarkdown(" + json.dumps(
        "**bold** and `x<y`\n\n```py\nprint('<b>')\n```\n- one\n- two\n\n[ok](https://a.example/?q=1&r=2) "
        "[bad](javascript:alert(1)) <img src=x onerror=alert(1)>") + ")")
    assert "<strong>bold</strong>" in html and "<code>x&lt;y</code>" in html
    assert '<pre><code class="language-py">print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert '<a href="https://a.example/?q=1&amp;r=2"' in html and "javascript:" not in html.split("[bad]")[0]
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html and 'href="javascript' not in html


def test_narrow_window(browser, demo, shots):
    """At phone width the conversation list hides behind its button; the composer stays usable."""
    context = browser.new_context(viewport={"width": 390, "height": 760})
    pg = _open(context, demo)
    expect(pg.locator("#side")).to_be_hidden()
    expect(pg.locator("#input")).to_be_visible()
    for control in ("#toggle-side", "#toggle-settings", "#toggle-status", "#send"):
        box = pg.locator(control).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, control  # nothing off the screen
    pg.click("#toggle-side")
    expect(pg.locator("#side")).to_be_visible()
    pg.screenshot(path=shots / "06-narrow-with-list.png")
    pg.click("#toggle-side")
    pg.screenshot(path=shots / "07-narrow.png")
    context.close()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with _server(tmp_path_factory, ["--model", "demo", "--max-tokens", str(N), "--api-key", KEY]) as s:
        yield s


def test_api_key(browser, keyed, shots):
    """The page loads without the key and asks for it; a wrong key is a clear error; the right one works."""
    assert httpx.get(keyed.base + "/").status_code == 200
    assert httpx.get(keyed.url + "/status").status_code == 401
    context = browser.new_context()
    pg = _open(context, keyed)
    expect(pg.locator("#key-form")).to_be_visible()
    expect(pg.locator("#banner")).to_contain_text("needs an API key")
    pg.fill("#api-key", "wrong")
    pg.keyboard.press("Enter")
    expect(pg.locator("#banner")).to_contain_text("invalid API key")
    expect(pg.locator("#banner")).to_contain_text("refused")
    pg.screenshot(path=shots / "08-wrong-key.png")
    pg.fill("#api-key", KEY)
    pg.keyboard.press("Enter")
    expect(pg.locator("#key-form")).to_be_hidden()
    expect(pg.locator("#banner")).to_be_hidden()
    _settings(pg, temperature=0)
    pg.fill("#input", "Hello there")
    pg.keyboard.press("Enter")
    _wait_reply(pg)
    want = _greedy(keyed, [{"role": "user", "content": "Hello there"}], key=KEY)
    assert _stored(pg)["messages"][1]["content"] == want.choices[0].message.content
    pg.screenshot(path=shots / "09-with-key.png")
    pg.evaluate("localStorage.setItem('kimi-mlx.key', 'wrong')")
    pg.fill("#input", "Again")
    pg.keyboard.press("Enter")
    expect(pg.locator(".msg.assistant >> nth=-1").locator(".error")).to_contain_text("401")
    context.close()


def test_no_ui(tmp_path_factory):
    with _server(tmp_path_factory, ["--model", "demo", "--no-ui"]) as s:
        r = httpx.get(s.base + "/")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /"
        assert httpx.get(s.base + "/ui/app.js").status_code == 404
        assert httpx.get(s.url + "/status").status_code == 200


@pytest.fixture(scope="module")
def k3v(tmp_path_factory):
    flags = ["--model", str(VL / "k3-vl-tiny"), "--served-model-name", "k3v", "--dtype", "float32",
             "--max-tokens", "8"]
    with _server(tmp_path_factory, flags) as s:
        yield s


def test_k3_reasoning_collapsed_and_an_image(browser, k3v, shots):
    """K3: the reasoning streams into a collapsed block (the API's greedy reasoning); an attached image reaches the
    vision tower (images_encoded grows; the stats show the usage's image tokens)."""
    context = browser.new_context()
    pg = _open(context, k3v)
    expect(pg.locator("#images-note")).to_have_text("")
    _settings(pg, temperature=0)
    pg.fill("#input", "Is 123 a prime?")
    pg.keyboard.press("Enter")
    node = _wait_reply(pg)
    reasoning = node.locator("details.reasoning")
    expect(reasoning).to_have_count(1)
    assert reasoning.evaluate("d => d.open") is False
    expect(reasoning.locator("summary")).to_be_visible()
    want = _greedy(k3v, [{"role": "user", "content": "Is 123 a prime?"}], max_tokens=8)
    msg = _stored(pg)["messages"][1]
    assert (msg["reasoning"], msg["content"]) == (want.choices[0].message.reasoning_content,
                                                  want.choices[0].message.content)
    pg.screenshot(path=shots / "10-k3-reasoning-collapsed.png")
    reasoning.locator("summary").click()
    assert reasoning.evaluate("d => d.open") is True
    pg.screenshot(path=shots / "11-k3-reasoning-open.png")
    pg.uncheck("#set-thinking")
    pg.locator(".msg[data-index='1']").get_by_role("button", name="Regenerate").click()
    node = _wait_reply(pg, 1)
    expect(node.locator("details.reasoning")).to_have_count(0)
    off = _greedy(k3v, [{"role": "user", "content": "Is 123 a prime?"}], max_tokens=8,
                  extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert _stored(pg)["messages"][1]["content"] == off.choices[0].message.content
    pg.check("#set-thinking")

    encoded = _health(k3v)["images_encoded"]
    pg.click("#new-chat")
    pg.set_input_files("#image-input", str(IMG0))
    expect(pg.locator("#attachments img")).to_have_count(1)
    pg.fill("#input", "Describe this image.")
    pg.keyboard.press("Enter")
    node = _wait_reply(pg)
    assert _health(k3v)["images_encoded"] == encoded + 1
    url = _stored(pg)["messages"][0]["images"][0]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe this image."},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    want = _greedy(k3v, messages, max_tokens=8)
    image_tokens = want.usage.prompt_tokens_details.image_tokens
    assert image_tokens > 0 and f"images {image_tokens} tok" in node.locator(".stats").inner_text()
    assert _stored(pg)["messages"][1]["reasoning"] == want.choices[0].message.reasoning_content
    expect(node.locator("img.thumb")).to_have_count(0)
    expect(pg.locator(".msg.user img.thumb")).to_have_count(1)
    pg.screenshot(path=shots / "12-k3-image.png")
    assert pg.errors == []
    context.close()
