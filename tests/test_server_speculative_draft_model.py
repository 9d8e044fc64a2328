"""``kimi-mlx serve --draft PATH``: a draft model (the demo model drafting for itself: every greedy draft is right)
gives the text and log-probabilities of the request with speculation off and reports its drafts in ``usage``; a
draft model that cannot be loaded, or whose tokenizer differs, stops the server with an error naming the path.
"""

import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from conftest import KL_FIXTURE
from serve_helpers import Server

N = 16
CHAT = [{"role": "user", "content": "Tell me about rivers."}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kimi-mlx-home"


@pytest.fixture(scope="module")
def server(tmp_path_factory, home):
    flags = ["--model", "demo", "--max-tokens", str(N), "--draft", "demo", "--num-draft-tokens", "4"]
    with Server(flags, tmp_path_factory.mktemp("serve"), home) as s:
        yield s


def test_a_draft_model_gives_the_plain_text(server):
    oai = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

    def chat(**kw):
        r = oai.chat.completions.create(model="demo", messages=CHAT, temperature=0, logprobs=True, **kw)
        return r.choices[0].message.content, [c.logprob for c in r.choices[0].logprobs.content], r.usage

    text, lps, usage = chat(extra_body={"speculative": False})
    assert usage.completion_tokens_details is None
    got, got_lps, usage = chat()
    assert got == text and got_lps == pytest.approx(lps, abs=1e-4)
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    stats = httpx.get(server.base + "/health").json()["stats"]["speculation"]
    assert stats["draft"] == "model" and stats["accepted"] == stats["drafted"] > 0
    assert "| draft demo (up to 4 tokens)" in server.log()


@pytest.mark.parametrize("draft, message", [
    ("/no/such/draft-model", "/no/such/draft-model"),
    (str(KL_FIXTURE / "hf"), "the draft model's tokenizer differs from the target's"),
])
def test_a_draft_model_that_cannot_serve_is_an_error(tmp_path, home, draft, message):
    cli = Path(sys.executable).parent / "kimi-mlx"
    out = subprocess.run([str(cli), "serve", "--model", "demo", "--draft", draft, "--port", "0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                           "KIMI_MLX_HOME": str(home)})
    assert out.returncode == 2 and "kimi-mlx: error:" in out.stderr and message in out.stderr
