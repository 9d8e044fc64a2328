"""The server against its own ``/openapi.json``, property-based (schemathesis drives hypothesis from the request
models' schemas): a real ``kimi-mlx serve`` (demo model, an API key, a small context so any reply is short) gets
bodies the schema accepts and bodies it refuses, on every route. No answer is a 5xx; every 4xx carries an error
body in the route's style (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", ...}`` on
``/v1/messages*``, Ollama's ``{"error": "..."}`` on ``/api/*``); the server keeps serving. Bounded in time: a fixed
number of examples per route, seeded, so a run is repeatable (about half a minute on 2 CPU cores).

The routes are collected from the document ``create_app`` builds for the same model id and key (schemathesis
makes one test per route at collection, before the server starts); ``test_served_document_is_the_one_fuzzed``
checks that the server serves exactly that document.
"""

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from serve_helpers import Server

from kimi_mlx.server.app import create_app

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "kimi-demo"
EXAMPLES = 10  # random ones per route and generation mode, after the boundary cases
DOCUMENT = create_app(lambda: None, model_id=MODEL, api_key=KEY).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.update(headers=AUTH)
schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=EXAMPLES, deterministic=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", "demo", "--api-key", KEY, "--served-model-name", MODEL, "--max-kv-size", "192",
             "--max-tokens", "8", "--max-batch", "4", "--max-queue", "64"]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield s


def test_served_document_is_the_one_fuzzed(server):
    assert httpx.get(server.base + "/openapi.json").json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_server_error(case, server):
    response = case.call(base_url=server.base, headers=AUTH, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if 400 <= response.status_code < 500 and case.method != "HEAD":
        body = response.json()
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
        elif case.path.startswith("/api/"):
            assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"], body
        else:
            assert body["error"]["type"] and body["error"]["message"], body


def test_still_serving_after_the_run(server):
    assert httpx.get(server.base + "/health").status_code == 200
    assert "Traceback" not in server.log(), server.log()
