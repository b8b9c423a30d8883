"""``serve --api-key``: the /v1 routes answer only a request with one of the keys, as vLLM's server;
the probes (/health, /metrics) stay open; ``VLLM_API_KEY`` is read when no key is given."""

from __future__ import annotations

import httpx
import openai
import pytest

from paged_attention.cli.serve import parser
from paged_attention.engine.llm_engine import LLMEngine
from paged_attention.serving import AsyncLLM, ServerThread, build_app
from paged_attention.serving.authentication import AuthenticationMiddleware, api_keys

KEYS = ["first-key", "second key with spaces"]


@pytest.fixture(scope="module")
def url():
    engine = LLMEngine(None, num_kv_blocks=64, max_num_seqs=4)
    server = ServerThread(build_app(AsyncLLM(engine), "tiny", api_keys=KEYS))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "first-key"},  # no scheme
        {"Authorization": "Basic first-key"},
        {"Authorization": "Bearer first-key-and-more"},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "wrong key", "no scheme", "basic", "a longer key", "empty"],
)
def test_a_request_without_one_of_the_keys_is_refused_before_the_engine(url, headers) -> None:
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    routes = (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"))
    for method, path in routes:
        answer = httpx.request(method, url + path, headers=headers, json=body, timeout=30)
        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"}), (method, path)


def test_either_key_opens_the_v1_routes_and_the_probes_need_none(url) -> None:
    for key in KEYS:
        with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60) as client:
            done = client.completions.create(model="tiny", prompt="a b", max_tokens=3, temperature=0)
            assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3
    answer = httpx.get(url + "/v1/models", headers={"Authorization": "bearer first-key"}, timeout=30)
    assert answer.status_code == 200  # the scheme's case does not matter, as in vLLM
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path
    assert httpx.options(url + "/v1/models", timeout=30).status_code != 401  # a CORS preflight


def test_the_command_line_and_the_environment(monkeypatch) -> None:
    assert parser().parse_args(["--api-key", "a", "b"]).api_key == ["a", "b"]
    assert parser().parse_args([]).api_key is None
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(None) == []
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(None) == ["from-env"]
    assert api_keys(["given"]) == ["given"]  # the command line wins, as in vLLM
    assert api_keys(["", "x"]) == ["x"]
    with pytest.raises(TypeError, match="api keys must be strings"):
        api_keys([3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one non-empty key"):
        AuthenticationMiddleware(lambda *a: None, [])  # type: ignore[arg-type]
