"""vLLM's ``/classify``, ``/score`` and ``/rerank`` on clusters of real processes.

A cross-encoder (a one-label ``LlamaForSequenceClassification`` made by ``make_classifier``),
colocated and 1P+1D: every route and spelling answers the offline ``LLM.score`` /
``LLM.classify`` values; rerank ranks, cuts to ``top_n`` and leaves the texts out when asked;
the pairs of one query reuse its cached blocks; in 1P+1D the decode worker runs no step. A
three-label classifier answers ``/classify`` with its labels. A causal LM scores by cosine.
The 400s name their field, and every route refuses a model of the wrong kind.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay import LLM, PoolingParams
from kvrelay.cli.launcher import Launcher
from kvrelay.engine.make_tiny import make_classifier
from tests.cluster_harness import TOPOLOGIES, metric_value, read_text, running_cluster

QUERY = "which animal purrs when it is happy?"
DOCUMENTS = ["A cat purrs.", "Stock markets fell on Monday.", "Dogs bark.", "Cats nap a lot."]
TOL = 1e-5


@pytest.fixture(scope="module")
def cross_encoder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_classifier(tiny_model_dir, tmp_path_factory.mktemp("ce"), ("relevant",), seed=3)


@pytest.fixture(scope="module")
def three_labels(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("three")
    return make_classifier(tiny_model_dir, out, ("neg", "neu", "pos"), seed=5)


@pytest.fixture(scope="module", params=["colocated", "1P+1D"])
def cluster(
    request: pytest.FixtureRequest, cross_encoder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launcher]:
    counts = TOPOLOGIES[request.param]
    with running_cluster(cross_encoder, tmp_path_factory.mktemp("score"), **counts) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def offline(cross_encoder: Path) -> LLM:
    return LLM(cross_encoder, warm_up=False)


def _post(launcher: Launcher, path: str, body: dict) -> httpx.Response:
    return httpx.post(launcher.url + path, json={"model": "tiny", **body}, timeout=60)


def test_rerank_ranks_the_offline_scores(cluster: Launcher, offline: LLM) -> None:
    want = [o.outputs.score for o in offline.score(QUERY, DOCUMENTS)]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(cluster, path, {"query": QUERY, "documents": DOCUMENTS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        for x in results:
            assert abs(x["relevance_score"] - want[x["index"]]) < TOL
            assert x["document"] == {"text": DOCUMENTS[x["index"]]}
        assert r.json()["id"].startswith("rerank-")
    tokenizer = offline.get_tokenizer()
    pairs = [
        tokenizer.join_pair(tokenizer.encode(QUERY, False), tokenizer.encode(d, False))
        for d in DOCUMENTS
    ]
    assert r.json()["usage"]["total_tokens"] == sum(len(p) for p in pairs)
    top = _post(
        cluster, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                             "return_documents": False},
    ).json()["results"]  # fmt: skip
    assert [x["index"] for x in top] == order[:2] and "document" not in top[0]


@pytest.mark.parametrize(
    ("first", "second"),
    [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")],
)
def test_score_takes_every_spelling(
    cluster: Launcher, offline: LLM, first: str, second: str
) -> None:
    one_to_n = _post(cluster, "/score", {first: QUERY, second: DOCUMENTS})
    assert one_to_n.status_code == 200, one_to_n.text
    want = [o.outputs.score for o in offline.score(QUERY, DOCUMENTS)]
    data = one_to_n.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCUMENTS)))
    assert all(abs(d["score"] - w) < TOL for d, w in zip(data, want, strict=True))
    assert data[0]["object"] == "score" and one_to_n.json()["object"] == "list"
    n_to_n = _post(cluster, "/v1/score", {first: [QUERY, DOCUMENTS[1]], second: DOCUMENTS[:2]})
    want_nn = [o.outputs.score for o in offline.score([QUERY, DOCUMENTS[1]], DOCUMENTS[:2])]
    got = [d["score"] for d in n_to_n.json()["data"]]
    assert all(abs(g - w) < TOL for g, w in zip(got, want_nn, strict=True))


def test_use_activation_false_gives_the_logit(cluster: Launcher, offline: LLM) -> None:
    r = _post(cluster, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[0], "use_activation": False})
    (want,) = offline.score(QUERY, DOCUMENTS[0], PoolingParams(use_activation=False))
    logit = r.json()["data"][0]["score"]
    assert abs(logit - want.outputs.score) < TOL
    (activated,) = offline.score(QUERY, DOCUMENTS[0])  # the sigmoid of that logit
    assert abs(1 / (1 + math.exp(-logit)) - activated.outputs.score) < TOL
    assert abs(logit - activated.outputs.score) > 1e-3


def test_pairs_of_one_query_reuse_its_blocks(cluster: Launcher) -> None:
    """Every pair starts with the query's tokens: a second rerank of the same query against
    other documents finds the query's full blocks cached, once per document."""
    query = " ".join(["purring cats and their happy moods"] * 8)  # several 16-token blocks

    def hits() -> float:
        total = 0.0
        for inst in cluster.get_json("/admin/instances")["data"]:
            text = read_text(inst["status_url"] + "/metrics")
            total += metric_value(text, "kvrelay_prefix_cache_hits_total", tier="device")
        return total

    assert _post(cluster, "/rerank", {"query": query, "documents": ["warmup"]}).status_code == 200
    before = hits()
    r = _post(cluster, "/rerank", {"query": query, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    num_query_blocks = len(cluster_tokens(cluster, query)) // 16
    assert num_query_blocks >= 2
    assert hits() - before >= len(DOCUMENTS) * num_query_blocks * 16


def cluster_tokens(cluster: Launcher, text: str) -> list[int]:
    body = {"model": "tiny", "prompt": text, "add_special_tokens": True}
    return httpx.post(cluster.url + "/tokenize", json=body, timeout=30).json()["tokens"]


def test_prefill_workers_score_alone(cluster: Launcher) -> None:
    assert _post(cluster, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).status_code == 200
    for inst in cluster.get_json("/admin/instances")["data"]:
        text = read_text(inst["status_url"] + "/metrics")
        steps = sum(
            metric_value(text, "kvrelay_engine_step_seconds_count", kind=kind)
            for kind in ("prefill", "mixed", "decode")
        )
        assert (steps == 0) == (inst["role"] == "decode"), (inst["role"], steps)


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "1:1, 1:N or N:N"),
        ("/score", {"text_1": "a", "documents": ["b"]}, "documents", "exactly one of"),
        ("/score", {"text_1": "a"}, "text_1", "exactly one of"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2", "at least one"),
        ("/score", {"text_1": "a", "text_2": [""]}, "text_2", "empty string"),
        ("/score", {"text_1": "a", "text_2": [{"type": "image_url"}]}, "text_2[0]", "string"),
        ("/score", {"text_1": "a", "text_2": "b", "instruction": "x"}, "instruction", ""),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ""),
        ("/rerank", {"documents": ["b"]}, "query", ""),
        ("/rerank", {"query": "a", "documents": ["w " * 5000]}, "documents", "context length"),
        ("/rerank", {"query": "a", "documents": "b", "priority": 3}, "priority", "first come"),
        ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc",
         ""),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(
    cluster: Launcher, path: str, body: dict, param: str, message: str
) -> None:
    r = _post(cluster, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_max_tokens_per_doc_fits_a_long_document(cluster: Launcher, offline: LLM) -> None:
    long_doc = "the cat purrs " * 2000
    body = {"query": QUERY, "documents": [long_doc], "max_tokens_per_doc": 40}
    r = _post(cluster, "/rerank", body)
    assert r.status_code == 200, r.text
    tokenizer = offline.get_tokenizer()
    ids = tokenizer.join_pair(
        tokenizer.encode(QUERY, False), tokenizer.encode(long_doc, False)[:40]
    )
    (want,) = offline.classify([ids])
    assert abs(r.json()["results"][0]["relevance_score"] - want.outputs.probs[0]) < TOL
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # truncate_prompt_tokens caps the pair, cutting the document (vLLM's bench client sends
    # -1: the context window)
    max_len = cluster.get_json("/v1/models")["data"][0]["max_model_len"]
    for cap, length in ((-1, max_len), (30, 30)):
        body = {"query": QUERY, "documents": [long_doc], "truncate_prompt_tokens": cap}
        r = _post(cluster, "/rerank", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == length
        query_ids = tokenizer.encode(QUERY, False)
        doc_ids = tokenizer.encode(long_doc, False)[: length - len(query_ids) - 2]  # two BOS
        (want,) = offline.classify([tokenizer.join_pair(query_ids, doc_ids)])
        assert abs(r.json()["results"][0]["relevance_score"] - want.outputs.probs[0]) < TOL
    body = {"query": QUERY, "documents": ["x"], "truncate_prompt_tokens": 0}
    assert _post(cluster, "/rerank", body).json()["error"]["param"] == "truncate_prompt_tokens"


def test_a_classifier_refuses_generation_and_embeddings(cluster: Launcher) -> None:
    r = _post(cluster, "/v1/embeddings", {"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "/classify, /score and /rerank" in r.json()["error"]["message"]
    r = _post(cluster, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_classify_answers_each_label(
    three_labels: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    offline = LLM(three_labels, warm_up=False)
    texts = ["I loved it", "meh", "terrible, awful"]
    want = [o.outputs.probs for o in offline.classify(texts)]
    logits = [o.outputs.probs for o in offline.classify(texts, PoolingParams(use_activation=False))]
    with running_cluster(
        three_labels, tmp_path_factory.mktemp("classify"),
        num_prefill=0, num_decode=0, num_colocated=1,
    ) as launcher:  # fmt: skip
        r = _post(launcher, "/classify", {"input": texts})
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want, strict=True):
            assert d["num_classes"] == 3 and all(abs(a - b) < TOL for a, b in zip(d["probs"], w))
            assert d["label"] == ("neg", "neu", "pos")[max(range(3), key=w.__getitem__)]
        raw = _post(launcher, "/classify", {"input": texts, "use_activation": False}).json()
        assert all(
            abs(a - b) < TOL
            for d, w in zip(raw["data"], logits, strict=True)
            for a, b in zip(d["probs"], w)
        )
        ids = _post(launcher, "/classify", {"input": [[5, 6, 7, 8]]}).json()["data"][0]
        assert ids["probs"] == pytest.approx(offline.classify([[5, 6, 7, 8]])[0].outputs.probs)
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == sum(len(offline.get_tokenizer().encode(t)) for t in texts)
        # three labels have no pair score
        r = _post(launcher, "/rerank", {"query": "a", "documents": ["b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "3 labels" in r.json()["error"]["message"]
    # a causal LM scores by the cosine of its embeddings, and does not classify
    causal = LLM(tiny_model_dir, warm_up=False)
    want_cos = [o.outputs.score for o in causal.score(QUERY, DOCUMENTS)]
    with running_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("cosine"),
        num_prefill=0, num_decode=0, num_colocated=1,
    ) as launcher:  # fmt: skip
        r = _post(launcher, "/score", {"queries": QUERY, "documents": DOCUMENTS})
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        assert all(abs(g - w) < TOL for g, w in zip(got, want_cos, strict=True))
        r = _post(launcher, "/classify", {"input": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
