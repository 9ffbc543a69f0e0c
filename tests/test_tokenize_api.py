"""``POST /tokenize`` and ``POST /detokenize`` against a real server (vLLM's shapes)."""

from __future__ import annotations

import httpx
import openai

from tests.engine_backend import API_MAX_MODEL_LEN, ApiServer

TEXT = "Hello there, how are you?"
MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": TEXT},
]


def post(server: ApiServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


def test_tokenize_prompt_matches_the_tokenizer(api_server: ApiServer) -> None:
    tok = api_server.tokenizer
    for add_special, expected in (
        (None, tok.encode(TEXT, True)),
        (True, tok.encode(TEXT, True)),
        (False, tok.encode(TEXT, False)),
    ):
        body = {"model": "tiny", "prompt": TEXT, "add_special_tokens": add_special}
        r = post(api_server, "/tokenize", body)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "count": len(expected),
            "max_model_len": API_MAX_MODEL_LEN,
            "tokens": expected,
        }


def test_tokenize_messages_counts_what_chat_completions_sends(api_server: ApiServer) -> None:
    r = post(api_server, "/tokenize", {"model": "tiny-alias", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{api_server.base_url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=1,
        temperature=0,  # type: ignore[arg-type]
    )
    assert chat.usage is not None and r.json()["count"] == chat.usage.prompt_tokens
    tok = api_server.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(rendered, False)
    no_gen = post(
        api_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_gen["tokens"] == tok.encode(rendered, False)


def test_tokenize_messages_with_tools_counts_what_chat_completions_sends(
    api_server: ApiServer,
) -> None:
    """Tools are part of the rendered prompt: /tokenize renders them as the chat endpoint
    does (they were dropped without a word before)."""
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [{"role": "user", "content": "hi"}]
    with_tools = post(api_server, "/tokenize", {"messages": messages, "tools": [tool]}).json()
    without = post(api_server, "/tokenize", {"messages": messages}).json()
    client = openai.OpenAI(base_url=f"{api_server.base_url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=messages, tools=[tool], tool_choice="none", max_tokens=1
    )  # type: ignore[arg-type]
    assert chat.usage is not None and with_tools["count"] == chat.usage.prompt_tokens
    assert with_tools["count"] > without["count"]


def test_tokenize_returns_token_strings_when_asked(api_server: ApiServer) -> None:
    body = post(api_server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    tok = api_server.tokenizer
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert "token_strs" not in post(api_server, "/tokenize", {"prompt": TEXT}).json()


def test_detokenize_round_trips(api_server: ApiServer) -> None:
    tokens = post(api_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    r = post(api_server, "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    assert post(api_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_bad_requests_name_the_parameter(api_server: ApiServer) -> None:
    vocab = api_server.tokenizer.vocab_size
    cases = [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": TEXT, "model": "nope"}, 404, "model"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
        ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": TEXT, "add_special_token": True}, 400, "add_special_token"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ]
    for path, body, status, param in cases:
        r = post(api_server, path, body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.json())
