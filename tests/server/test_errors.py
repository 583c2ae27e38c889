"""Bad input: each case gets a 4xx with an OpenAI-style error body, then a good request succeeds."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MAX_N, MAX_REQUEST_BYTES, MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture
def still_serves(http: httpx.Client, client: openai.OpenAI):
    """After each bad request, the server must answer a good one normally."""
    yield
    resp = http.post(CHAT, json=GOOD_CHAT)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=1).usage.completion_tokens == 1


pytestmark = pytest.mark.usefixtures("still_serves")


def test_malformed_json(http: httpx.Client) -> None:
    resp = http.post(CHAT, content=b'{"model": "tiny-llama", "messages": [', headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(resp, 400, code="invalid_json")["message"]


def test_body_not_an_object(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json=["a", "list"]), 400, code="invalid_json")


def test_wrong_field_type(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "max_tokens": "many"}), 400, param="max_tokens")
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "messages": "hello"}), 400, param="messages")
    assert_error(http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": {"a": 1}}), 400, param="prompt")


def test_missing_messages(http: httpx.Client) -> None:
    err = assert_error(http.post(CHAT, json={"model": MODEL_NAME}), 400, param="messages",
                       code="missing_required_parameter")
    assert "messages" in err["message"]


def test_empty_message_list(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "empty_array"


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]


def test_prompt_longer_than_context(http: httpx.Client) -> None:
    long_ids = [100] * (MAX_MODEL_LEN + 10)
    assert_error(http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": long_ids}), 400,
                 code="context_length_exceeded")
    long_text = "word " * 4000  # over 16k characters: templated and tokenized off the event loop
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "user", "content": long_text}]}),
                       400, code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in err["message"]


@pytest.mark.parametrize("value", [0, -3])
def test_max_tokens_not_positive(http: httpx.Client, value: int) -> None:
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "max_tokens": value}), 400, param="max_tokens")
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "max_completion_tokens": value}), 400,
                 param="max_completion_tokens")
    assert_error(http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": value}), 400,
                 param="max_tokens")


def test_max_tokens_beyond_context(http: httpx.Client) -> None:
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "max_tokens": MAX_MODEL_LEN}), 400, param="max_tokens",
                       code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in err["message"]


def test_negative_temperature(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "temperature": -0.5}), 400, param="temperature")


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_top_p_out_of_range(http: httpx.Client, value: float) -> None:
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "top_p": value}), 400, param="top_p")


def test_oversized_body(http: httpx.Client) -> None:
    big = {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}]}
    assert_error(http.post(CHAT, json=big), 413, code="request_too_large")


def test_oversized_body_without_content_length(http: httpx.Client) -> None:
    def chunks():
        yield b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_REQUEST_BYTES // 4096 + 2):
            yield b"y" * 4096
        yield b'"}]}'

    assert_error(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_invalid_utf8(http: httpx.Client) -> None:
    body = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}'
    err = assert_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400,
                       code="invalid_encoding")
    assert "UTF-8" in err["message"]


def test_n_above_maximum(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       n=MAX_N + 1)
    assert e.value.body["param"] == "n" and str(MAX_N) in e.value.body["message"]


def test_token_id_outside_vocabulary(http: httpx.Client) -> None:
    assert_error(http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": [1, 2, 10**7]}), 400,
                 code="invalid_token_id")


def test_empty_prompt(http: httpx.Client) -> None:
    assert_error(http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": []}), 400, param="prompt")
    assert_error(http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": ""}), 400, param="prompt")


def test_top_logprobs_without_logprobs(http: httpx.Client) -> None:
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "top_logprobs": 2}), 400, param="top_logprobs")
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "logprobs": True, "top_logprobs": 50}), 400,
                 param="top_logprobs")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(CHAT), 405)
