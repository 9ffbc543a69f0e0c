"""The disaggregated cluster with real processes, real sockets and the official openai client.

Greedy outputs equal the offline engine's for colocated, 1P+1D and 2P+2D clusters over shm
and tcp; usage adds up; client disconnects free blocks; after every test each worker
reports zero used or leaked blocks and no shared-memory segment remains.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from kvrelay import LLM, SamplingParams
from tests.cluster_harness import running_cluster, wait_idle

PROMPTS = [
    "The cache moves to the decode worker",
    "a",
    "Prefill computes the prompt; decode continues it token by token. " * 6,
    "数据在两个进程之间移动 🚀",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    completions = [o.outputs[0] for o in llm.generate(PROMPTS, greedy)]
    chat = llm.chat([{"role": "user", "content": "Say hi"}], greedy)[0].outputs[0]
    return completions, chat


def client(launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)


def complete(c: openai.OpenAI, prompt: str, **kw):
    return c.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_openai_client_against_1p1d(tiny_model_dir, tmp_path, offline):
    completions, chat = offline
    with running_cluster(tiny_model_dir, tmp_path) as launcher:
        c = client(launcher)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        res = complete(c, PROMPTS[0])
        assert res.choices[0].text == completions[0].text
        assert res.choices[0].finish_reason == "length"
        assert res.usage.completion_tokens == MAX_TOKENS
        assert res.usage.total_tokens == res.usage.prompt_tokens + MAX_TOKENS

        stream = complete(c, PROMPTS[0], stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == completions[0].text
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert chunks[-1].usage.prompt_tokens == res.usage.prompt_tokens

        msgs = [{"role": "user", "content": "Say hi"}]
        kw = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
        reply = c.chat.completions.create(model="tiny", messages=msgs, **kw)
        assert reply.choices[0].message.content == chat.text
        assert reply.usage.completion_tokens == len(chat.token_ids)
        streamed = c.chat.completions.create(model="tiny", messages=msgs, stream=True, **kw)
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
        assert text == chat.text


CONFIGS = {
    "colocated": {"num_prefill": 0, "num_decode": 0, "num_colocated": 1},
    "1p1d-shm": {"num_prefill": 1, "num_decode": 1, "transport": "shm"},
    "1p1d-tcp": {"num_prefill": 1, "num_decode": 1, "transport": "tcp"},
    "2p2d-shm": {"num_prefill": 2, "num_decode": 2, "transport": "shm"},
    "2p2d-tcp": {"num_prefill": 2, "num_decode": 2, "transport": "tcp"},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_same_greedy_outputs_in_every_topology(tiny_model_dir, tmp_path, offline, config):
    completions, _ = offline
    with running_cluster(tiny_model_dir, tmp_path, **CONFIGS[config]) as launcher:
        c = client(launcher)
        batch = PROMPTS * 3
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: complete(c, p), batch))
        assert [r.choices[0].text for r in results] == [o.text for o in completions] * 3
        metrics = launcher.get_json("/admin/instances")["data"]
        if config != "colocated":
            decodes = [m for m in metrics if m["role"] == "decode"]
            assert len(decodes) == CONFIGS[config]["num_decode"]


def test_client_disconnect_frees_blocks(tiny_model_dir, tmp_path):
    with running_cluster(tiny_model_dir, tmp_path) as launcher:
        c = client(launcher)
        stream = c.completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=2000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        stats = wait_idle(launcher)
        assert all(s["num_running"] == 0 for s in stats.values())
        assert launcher.get_json("/admin/instances")["num_inflight"] == 0


def test_stop_string_ends_the_request_on_the_workers(tiny_model_dir, tmp_path, offline):
    completions, _ = offline
    text = completions[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a prompt whose output has a visible middle"
    with running_cluster(tiny_model_dir, tmp_path) as launcher:
        res = complete(client(launcher), PROMPTS[0], stop=[stop])
        assert res.choices[0].text == text[: text.index(stop)]
        assert res.choices[0].finish_reason == "stop"
        time.sleep(0.2)
