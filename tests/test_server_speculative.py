"""``kimi-mlx serve --draft lookup`` as a real process: a request's greedy text and log-probabilities are those of the
same request with speculation off (``"speculative": false``), with OpenAI's Predicted Outputs right or wrong, with
concurrent clients (turns alternate between speculative passes and batched steps) and on the Anthropic route;
``usage.completion_tokens_details`` counts accepted / rejected prediction tokens; bad ``prediction`` values are 400s
in OpenAI's error shape; ``"speculative": false`` turns it off on the Anthropic and Responses routes too;
``/health``, ``/v1/status`` and the log report the draft counts.
"""

import concurrent.futures

import anthropic
import httpx2 as httpx
import openai
import pytest
from serve_helpers import Server

N = 24
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a line about the sea."}]
OFF = {"speculative": False}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kimi-mlx-home"


@pytest.fixture(scope="module")
def server(tmp_path_factory, home):
    flags = ["--model", "demo", "--max-tokens", str(N), "--draft", "lookup", "--num-draft-tokens", "6"]
    with Server(flags, tmp_path_factory.mktemp("serve"), home) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def _chat(oai, messages=CHAT, **kw):
    r = oai.chat.completions.create(model="demo", messages=messages, temperature=0, logprobs=True, **kw)
    return r.choices[0].message.content, [c.logprob for c in r.choices[0].logprobs.content], r.usage


def _stats(server) -> dict:
    return httpx.get(server.base + "/health").json()["stats"]["speculation"]


def test_predicted_outputs_right_and_wrong_equal_plain(oai, server):
    """A prediction that is the reply (drafts accepted) and one that is wrong everywhere give the text and
    log-probabilities of the request without speculation; usage counts the prediction tokens."""
    text, lps, usage = _chat(oai, extra_body=OFF)
    assert usage.completion_tokens_details is None  # no prediction, no drafts
    before = _stats(server)
    got, got_lps, usage = _chat(oai, prediction={"type": "content", "content": text})
    assert got == text and got_lps == pytest.approx(lps, abs=1e-4)
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= N // 3
    after = _stats(server)
    assert after["accepted"] - before["accepted"] == details.accepted_prediction_tokens
    drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert after["drafted"] - before["drafted"] == drafted
    wrong = " ".join(["zebra quartz"] * 20)
    got, got_lps, usage = _chat(oai, prediction={"type": "content", "content": [{"type": "text", "text": wrong}]})
    assert got == text and got_lps == pytest.approx(lps, abs=1e-4)
    assert usage.completion_tokens_details.rejected_prediction_tokens > 0
    streamed = oai.chat.completions.create(model="demo", messages=CHAT, temperature=0, stream=True,
                                           prediction={"type": "content", "content": text},
                                           stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_concurrent_clients_get_their_plain_output(oai, server):
    """Four chats at once with their replies as predictions and different lengths (the longest runs alone at the
    end and speculates; before, the batch is shared): each text and its log-probabilities equal the same request
    with speculation off."""
    asks = ["Write a line about the sea.", "Name three colors.", "Count to five.", "Say hello twice."]
    lengths = [N, 6, 10, 14]

    def chat(ask, n, extra=None, prediction=None):
        kw = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
        return _chat(oai, [{"role": "user", "content": ask}], max_completion_tokens=n, extra_body=extra, **kw)

    plain = [chat(a, n, OFF) for a, n in zip(asks, lengths)]
    before = _stats(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(chat, asks, lengths, [None] * 4, [text for text, _, _ in plain]))
    for (text, lps, _), (want, want_lps, _) in zip(got, plain):
        assert text == want and lps == pytest.approx(want_lps, abs=1e-4)
    assert _stats(server)["accepted"] > before["accepted"]


def test_anthropic_messages_speculate_with_the_same_text(server, oai):
    """The Anthropic route speculates too (its usage has no field for it: the server's stats count it), unless
    the request sends ``"speculative": false``."""
    text, _, _ = _chat(oai, extra_body=OFF)
    before = _stats(server)
    claude = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)
    m = claude.messages.create(model="demo", max_tokens=N, system="Be brief.",
                               messages=[{"role": "user", "content": CHAT[1]["content"]}])
    assert m.content[0].text == text
    after = _stats(server)
    assert after["passes"] > before["passes"]
    m = claude.messages.create(model="demo", max_tokens=N, system="Be brief.", extra_body=OFF,
                               messages=[{"role": "user", "content": CHAT[1]["content"]}])
    assert m.content[0].text == text and _stats(server) == after


def test_responses_speculate_unless_turned_off(server, oai):
    """The Responses API speculates too; ``"speculative": false`` turns it off there as well, same text."""
    before = _stats(server)
    r = oai.responses.create(model="demo", input=CHAT[1]["content"], instructions="Be brief.", max_output_tokens=N,
                             temperature=0)
    after = _stats(server)
    assert after["passes"] > before["passes"]
    off = oai.responses.create(model="demo", input=CHAT[1]["content"], instructions="Be brief.",
                               max_output_tokens=N, temperature=0, extra_body=OFF)
    assert off.output_text == r.output_text and _stats(server) == after


@pytest.mark.parametrize("prediction, param", [
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "prediction.content"),
    ({"type": "content"}, "prediction.content"),
    ("just text", "prediction"),
])
def test_bad_predictions_are_400s(server, prediction, param):
    r = httpx.post(server.url + "/chat/completions", json={"model": "demo", "messages": CHAT, "prediction": prediction})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param)


def test_speculative_must_be_a_boolean(server):
    r = httpx.post(server.url + "/completions", json={"model": "demo", "prompt": "Hi", "speculative": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"


def test_health_status_and_log_report_the_drafts(server):
    health = httpx.get(server.base + "/health").json()["stats"]["speculation"]
    status = httpx.get(server.url + "/status").json()["stats"]["speculation"]
    assert health["draft"] == status["draft"] == "lookup"
    assert 0 < health["accepted"] <= health["drafted"] and health["passes"] > 0
    log = server.log()
    assert "| draft lookup (up to 6 tokens)" in log
    assert "accepted (" in log and "| drafts " in log


@pytest.mark.parametrize("flags, message", [
    (["--draft-max-batch", "2"], "--draft-max-batch 2: only 1 is supported"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1, got 0"),
])
def test_bad_draft_flags_are_refused(tmp_path, flags, message):
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).parent / "kimi-mlx"
    out = subprocess.run([str(cli), "serve", "--model", "demo", "--draft", "lookup", *flags], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr
