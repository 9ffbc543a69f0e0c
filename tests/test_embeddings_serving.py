"""``POST /v1/embeddings`` on a cluster of real processes, through the official ``openai``
client and LangChain's ``OpenAIEmbeddings``: the vectors of the offline ``LLM.embed`` (base64,
the client's default, and float), batches of strings and of token ids, ``dimensions``, usage;
in 1P+1D the prefill worker computes them and the decode worker runs no step; the 400s name
the field at fault; and nothing leaks."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from kvrelay import LLM, PoolingParams
from kvrelay.cli.launcher import Launcher
from tests.cluster_harness import TOPOLOGIES, metric_value, read_text, running_cluster

TEXTS = ["the quick brown fox", "jumps over the lazy dog " * 6, "a"]
TOKENS = [[5, 6, 7, 8, 9, 10] * 6, [300 + i % 7 for i in range(50)]]
TOL = 1e-5


@pytest.fixture(scope="module", params=["colocated", "1P+1D"])
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launcher]:
    counts = TOPOLOGIES[request.param]
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("embed"), **counts) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, warm_up=False)


def _client(launcher: Launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and np.allclose(got, want, atol=TOL)


def test_the_openai_client_gets_the_offline_vectors(cluster: Launcher, offline: LLM) -> None:
    client = _client(cluster)
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    got = client.embeddings.create(model="tiny", input=TEXTS)  # base64 on the wire
    assert [d.index for d in got.data] == [0, 1, 2]
    assert all(_close(d.embedding, w) for d, w in zip(got.data, want, strict=True))
    tokenizer = offline.get_tokenizer()
    num_tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == num_tokens
    assert got.model == "tiny"
    as_floats = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    assert _close(as_floats.data[0].embedding, want[0])
    # token ids, a batch of them, and Matryoshka dimensions
    ids = client.embeddings.create(model="tiny", input=TOKENS, dimensions=16)
    want_ids = offline.embed(TOKENS, PoolingParams(dimensions=16))
    assert all(
        _close(d.embedding, w.outputs.embedding) for d, w in zip(ids.data, want_ids, strict=True)
    )
    assert len(ids.data[0].embedding) == 16
    assert abs(np.linalg.norm(ids.data[0].embedding) - 1.0) < 1e-5


def test_raw_base64_and_vllm_extras(cluster: Launcher, offline: LLM) -> None:
    body = {"model": "tiny", "input": TOKENS[0], "encoding_format": "base64"}
    body["use_activation"] = False
    r = httpx.post(cluster.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "list" and data["id"].startswith("embd-")
    vector = np.frombuffer(base64.b64decode(data["data"][0]["embedding"]), "<f4")
    (want,) = offline.embed([TOKENS[0]], PoolingParams(use_activation=False))
    assert _close(vector.tolist(), want.outputs.embedding)
    assert np.linalg.norm(vector) > 1.5  # not normalized
    body = {"model": "tiny", "input": TOKENS[1], "truncate_prompt_tokens": 8}
    r = httpx.post(cluster.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8
    (want,) = offline.embed([TOKENS[1][-8:]])
    assert _close(r.json()["data"][0]["embedding"], want.outputs.embedding)


def test_vllms_chat_form_embeds_the_rendered_conversation(cluster: Launcher, offline: LLM) -> None:
    """``messages`` instead of ``input``: the chat template's tokens, as /tokenize renders
    them (no generation prompt unless asked), embedded as one input."""
    messages = [{"role": "system", "content": "Embed for search."},
                {"role": "user", "content": "the quick brown fox"}]  # fmt: skip
    for add in (False, True):
        body = {"model": "tiny", "messages": messages, "add_generation_prompt": add}
        ids = httpx.post(cluster.url + "/tokenize", json=body, timeout=30).json()["tokens"]
        r = httpx.post(cluster.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        (want,) = offline.embed([ids])
        assert _close(r.json()["data"][0]["embedding"], want.outputs.embedding)
    both = {"model": "tiny", "messages": messages, "input": "x"}
    r = httpx.post(cluster.url + "/v1/embeddings", json=both, timeout=30)
    assert r.status_code == 400 and "exactly one of 'input' and 'messages'" in r.text


def test_langchain_embeddings(cluster: Launcher, offline: LLM) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model="tiny", base_url=cluster.url + "/v1", api_key="x",
        check_embedding_ctx_length=False,  # its own tiktoken ids mean nothing to this model
    )  # fmt: skip
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    docs = embeddings.embed_documents(TEXTS)
    assert all(_close(d, w) for d, w in zip(docs, want, strict=True))
    assert _close(embeddings.embed_query(TEXTS[0]), want[0])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "'input' must not be empty"),
        ({"input": ""}, "input", "must not hold an empty string"),
        ({"input": [1.5]}, "input", "array of token ids"),
        ({"input": "x", "dimensions": 100000}, "dimensions", "'dimensions' must be >= 1"),
        ({"input": "x", "dimensions": 4096}, "dimensions", "this model's embeddings have"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "x", "pooling": "max"}, "pooling", "Unrecognized request argument"),
        ({"input": [10**6]}, "input", "outside the vocabulary"),
        ({"input": "word " * 5000}, "input", "context"),
        ({"input": "x", "cache_salt": ""}, "cache_salt", "cache_salt"),
        ({"input": "x", "priority": 3}, "priority", "schedules first come"),
        ({"input": "x", "use_activation": True, "normalize": False}, "use_activation", "disagree"),
    ],
)
def test_bad_requests_name_the_field(
    cluster: Launcher, body: dict, param: str, message: str
) -> None:
    r = httpx.post(cluster.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_an_input_may_fill_the_context_window(cluster: Launcher) -> None:
    """Nothing is generated after an embedding's input: it may hold the whole window."""
    max_len = cluster.get_json("/v1/models")["data"][0]["max_model_len"]
    full = _client(cluster).embeddings.create(model="tiny", input=[([5, 6] * max_len)[:max_len]])
    assert full.usage.prompt_tokens == max_len
    r = httpx.post(
        cluster.url + "/v1/embeddings", json={"model": "tiny", "input": [[5] * (max_len + 1)]}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"


def test_unknown_model_is_a_404(cluster: Launcher) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(cluster).embeddings.create(model="gpt-4", input="x")


def test_prefill_workers_compute_them_alone(cluster: Launcher) -> None:
    """In 1P+1D the prefill worker runs every embedding end to end: no hand-off, and the
    decode worker runs no step for them. The router counts the inputs and their tokens."""
    router = read_text(cluster.url + "/metrics")
    before = [metric_value(router, f"kvrelay_embedding_input{s}_total") for s in ("s", "_tokens")]
    _client(cluster).embeddings.create(model="tiny", input=[TOKENS[0]] * 4)
    router = read_text(cluster.url + "/metrics")
    after = [metric_value(router, f"kvrelay_embedding_input{s}_total") for s in ("s", "_tokens")]
    assert after[0] - before[0] == 4 and after[1] - before[1] == 4 * len(TOKENS[0])
    steps = {}
    for inst in cluster.get_json("/admin/instances")["data"]:
        text = read_text(inst["status_url"] + "/metrics")
        steps[inst["role"]] = sum(
            metric_value(text, "kvrelay_engine_step_seconds_count", kind=kind)
            for kind in ("prefill", "mixed", "decode")
        )
        if inst["role"] == "decode":
            assert not metric_value(text, "kvrelay_kv_transfer_bytes_total")
    if "decode" in steps:
        assert steps["decode"] == 0 and steps["prefill"] > 0
    else:
        assert steps["colocated"] > 0


def test_workers_pool_as_their_pooler_config_says(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``--pooler-config`` on the workers: a colocated cluster answers with mean-pooled,
    unnormalized vectors, the offline engine's with the same setting."""
    pooler = {"pooling_type": "MEAN", "normalize": False}
    args = ("--num-blocks", "256", "--threads", "1", "--pooler-config", json.dumps(pooler))
    want = LLM(tiny_model_dir, warm_up=False, pooler_config=pooler).embed(TOKENS)
    with running_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("embed-mean"), worker_args=args,
        num_prefill=0, num_decode=0, num_colocated=1,
    ) as launcher:  # fmt: skip
        got = _client(launcher).embeddings.create(model="tiny", input=TOKENS)
    for d, w in zip(got.data, want, strict=True):
        assert _close(d.embedding, w.outputs.embedding)
    assert abs(np.linalg.norm(got.data[0].embedding) - 1.0) > 1e-3  # not normalized


def test_kvrelay_up_passes_the_pooler_config_and_refuses_a_bad_one(tiny_model_dir: Path) -> None:
    from kvrelay.cli import build_parser
    from kvrelay.cli.engine_args import engine_cli_args

    args = build_parser().parse_args(
        ["up", "--model", str(tiny_model_dir), "--pooler-config", '{"pooling_type": "cls"}']
    )
    words = engine_cli_args(args)
    passed = json.loads(words[words.index("--pooler-config") + 1])
    assert passed == {"pooling_type": "CLS", "normalize": True}
    bad = subprocess.run(
        [sys.executable, "-m", "kvrelay", "up", "--model", str(tiny_model_dir),
         "--pooler-config", '{"pooling_type": "max"}'],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "pooling_type must be one of LAST, MEAN, CLS, got 'MAX'" in bad.stderr
