"""The disaggregated cluster with real processes, real sockets and the official openai client.

Greedy outputs equal the offline engine's for colocated, 1P+1D and 2P+2D clusters over shm
and tcp; usage adds up; client disconnects free blocks; a drained decode worker gets no
hand-off until it is undrained (both token-protected), then gets them again; after every
test each worker reports zero used or leaked blocks and no shared-memory segment remains.
With two routers, each receives the token events of its own requests only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import msgpack
import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.protocol import messages
from kvrelay.protocol.errors import ProtocolError
from kvrelay.protocol.messages import WIRE_TYPES, GenerateRequest, decode, encode
from tests.cluster_harness import (
    admin_request,
    metric_value,
    read_text,
    running_cluster,
    wait_idle,
)

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


def _admin_post(launcher, path: str, token: str | None) -> tuple[int, dict]:
    return admin_request(launcher, path, "POST", token=token)


def _decode_transfer_bytes(launcher) -> float:
    (decode,) = [i for i in launcher.get_json("/admin/instances")["data"] if i["role"] == "decode"]
    return metric_value(
        read_text(decode["status_url"] + "/metrics"), "kvrelay_kv_transfer_bytes_total"
    )


def _reported_draining(launcher) -> dict[str, bool]:
    """Per instance, whether its last load report says it drains (the worker's word)."""
    data = launcher.get_json("/admin/instances")["data"]
    return {i["instance_id"]: i["draining_reported"] for i in data}


def _draining(launcher) -> dict[str, bool]:
    return {i["instance_id"]: i["draining"] for i in launcher.get_json("/admin/instances")["data"]}


def _wait(what: str, check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_drained_instance_serves_again_once_undrained(
    tiny_model_dir, tmp_path, offline, monkeypatch
):
    completions, _ = offline
    monkeypatch.setenv("KVRELAY_ADMIN_TOKEN", "undrain-s3cret")  # the router and get_json read it
    with running_cluster(tiny_model_dir, tmp_path) as launcher:
        c = client(launcher)
        assert complete(c, PROMPTS[0]).choices[0].text == completions[0].text
        handed_off = _decode_transfer_bytes(launcher)
        assert handed_off > 0

        assert _admin_post(launcher, "/admin/instances/decode-0/drain", None)[0] == 401
        assert _admin_post(launcher, "/admin/instances/decode-0/drain", "undrain-s3cret") == (
            200, {"instance_id": "decode-0", "draining": True},
        )  # fmt: skip
        assert _draining(launcher)["decode-0"]  # the router's word, at once
        _wait("decode-0 to report draining", lambda: _reported_draining(launcher)["decode-0"])
        # prefill-0 runs it end to end: nothing reaches the drained decode worker
        assert complete(c, PROMPTS[1]).choices[0].text == completions[1].text
        assert _decode_transfer_bytes(launcher) == handed_off

        assert _admin_post(launcher, "/admin/instances/decode-0/undrain", None)[0] == 401
        assert _admin_post(launcher, "/admin/instances/nope/undrain", "undrain-s3cret")[0] == 404
        assert _admin_post(launcher, "/admin/instances/decode-0/undrain", "undrain-s3cret") == (
            200, {"instance_id": "decode-0", "draining": False},
        )  # fmt: skip
        # a report made before the worker took the Undrain in says draining: wait for a later one
        _wait(
            "decode-0 to report not draining",
            lambda: not _reported_draining(launcher)["decode-0"],
        )
        assert not _draining(launcher)["decode-0"]
        assert complete(c, PROMPTS[2]).choices[0].text == completions[2].text
        assert _decode_transfer_bytes(launcher) > handed_off  # the hand-off goes to it again


def test_two_routers_get_only_their_own_requests_events(tiny_model_dir, tmp_path, offline):
    completions, _ = offline
    with running_cluster(tiny_model_dir, tmp_path, num_routers=2) as launcher:
        urls = launcher.router_urls
        clients = [openai.OpenAI(base_url=u + "/v1", api_key="unused", max_retries=0) for u in urls]
        jobs = [(i % 2, PROMPTS[i % len(PROMPTS)]) for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda job: complete(clients[job[0]], job[1]), jobs))
        expected = {p: o.text for p, o in zip(PROMPTS, completions)}
        assert [r.choices[0].text for r in results] == [expected[p] for _, p in jobs]
        decode = next(
            i for i in launcher.get_json("/admin/instances")["data"] if i["role"] == "decode"
        )
        decode_metrics = read_text(decode["status_url"] + "/metrics")
        assert metric_value(decode_metrics, "kvrelay_kv_transfer_bytes_total") > 0  # handed off
        for url in urls:
            metrics = read_text(url + "/metrics")
            assert metric_value(metrics, "kvrelay_requests_total") == 4, url
            dropped = metric_value(metrics, "kvrelay_token_events_dropped_total")
            assert dropped == 0, f"{url} got {dropped:.0f} events of the other router's requests"


def test_messages_from_an_older_process_lack_the_origin():
    """A GenerateRequest or KvReady without ``origin`` decodes with ``origin=""`` (the
    worker then answers every router); one with too few fields is still refused; one from a
    newer process, with fields this one does not know, decodes to the fields it knows."""
    msg = GenerateRequest(
        "r1", [1, 2], SamplingParams(max_tokens=4), [], None, origin="router-a", attempt=2
    )
    assert decode(encode(msg)) == msg
    values = [getattr(msg, f.name) for f in dataclasses.fields(GenerateRequest)]
    tag = WIRE_TYPES.index(GenerateRequest)

    def packed(fields: list) -> bytes:
        ext = msgpack.ExtType(1, msgpack.packb([tag, *fields], default=messages._default))
        return msgpack.packb(ext)

    # an older process sends no ``pooling``, nor ``seq``, nor (older still) ``attempt``, nor
    # ``origin``
    assert values[-4:] == ["router-a", 2, 0, None]
    assert decode(packed(values[:-4])) == dataclasses.replace(msg, origin="", attempt=0)
    assert decode(packed(values[:-3])) == dataclasses.replace(msg, attempt=0)
    assert decode(packed(values[:-2])) == msg
    assert decode(packed(values[:-1])) == msg
    with pytest.raises(ProtocolError, match="GenerateRequest: expected 9 fields, got 2"):
        decode(packed(values[:2]))
    # a newer process adds fields last (a rolling upgrade that starts with the routers)
    assert decode(packed([*values, "a later field", {"nested": [1, 2]}])) == msg
