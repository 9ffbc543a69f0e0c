"""Sequence classifiers and pair scoring in the engine (``LLM.classify``, ``LLM.score``)
against transformers.

``*ForSequenceClassification`` checkpoints (Llama and Qwen2, one label and three) made by
``make_classifier`` from tiny causal LMs: the labels' softmax (a sigmoid for one label) and
the raw logits equal transformers' within 1e-5 (float32), chunked under a small step budget
and batched. A one-label classifier scores pairs as a cross-encoder over
transformers' ``tokenizer(query, text_pair=document)`` ids; a causal LM scores them by the
cosine of its embeddings. Then the config rules (labels, activations, the pair separator)
and the refusals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvrelay import LLM, PoolingParams, SamplingParams  # noqa: E402
from kvrelay.engine.admission import RequestError  # noqa: E402
from kvrelay.engine.identity import CheckpointError  # noqa: E402
from kvrelay.engine.make_tiny import make_classifier, make_tiny  # noqa: E402
from kvrelay.protocol.pooling import ClassifierConfig, PoolingConfigError  # noqa: E402
from kvrelay.protocol.scoring import ScoringError, pair_indices  # noqa: E402
from kvrelay.text.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (1, 5, 16, 37, 90)]
QUERY = "which animal purrs when it is happy?"
DOCUMENTS = ["A cat purrs.", "Stock markets fell on Monday.", "Dogs bark and wag their tails."]
TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def causal_lm(request, tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny")


@pytest.fixture(scope="module")
def cross_encoder(causal_lm: Path) -> Path:
    return make_classifier(causal_lm, causal_lm.parent / "cross-encoder", ("relevant",), seed=3)


@pytest.fixture(scope="module")
def three_labels(causal_lm: Path) -> Path:
    return make_classifier(causal_lm, causal_lm.parent / "three", ("neg", "neu", "pos"), seed=5)


def _llm(model_dir: Path, **kwargs) -> LLM:
    args = dict(max_model_len=256, num_blocks=96, block_size=16, max_num_batched_tokens=48)
    return LLM(model_dir, warm_up=False, **{**args, **kwargs})


def _hf_logits(model_dir: Path, inputs: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in inputs]


def test_classify_matches_transformers(three_labels: Path, cross_encoder: Path) -> None:
    for ckpt, activate in ((three_labels, lambda x: x.softmax(0)), (cross_encoder, torch.sigmoid)):
        llm = _llm(ckpt)
        assert "lm_head" not in llm.engine.runner.model.weights
        outs = llm.classify(PROMPTS)
        raw = llm.classify(PROMPTS, PoolingParams(use_activation=False))
        for out, logits_out, want in zip(outs, raw, _hf_logits(ckpt, PROMPTS), strict=True):
            got = torch.tensor(out.outputs.probs)
            assert out.outputs.num_classes == want.numel()
            assert torch.allclose(got, activate(want), atol=TOL), (ckpt.name, got, want)
            assert torch.allclose(torch.tensor(logits_out.outputs.probs), want, atol=TOL)


def test_classify_batched_and_chunked_agrees_with_alone(three_labels: Path) -> None:
    """Prompts chunked under a 16-token budget and sharing steps get what each gets alone
    (within float32 rounding: the steps' row counts pick different GEMM kernels)."""
    llm = _llm(three_labels, max_num_batched_tokens=16)
    alone = [llm.classify([p])[0].outputs.probs for p in PROMPTS]
    together = [o.outputs.probs for o in llm.classify(PROMPTS)]
    for a, b in zip(alone, together, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=TOL)


def test_cross_encoder_scores_transformers_pairs(cross_encoder: Path) -> None:
    llm = _llm(cross_encoder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    pairs = [hf_tok(QUERY, text_pair=d)["input_ids"] for d in DOCUMENTS]
    outs = llm.score(QUERY, DOCUMENTS)
    for out, ids, logits in zip(outs, pairs, _hf_logits(cross_encoder, pairs), strict=True):
        assert out.prompt_token_ids == ids
        assert abs(out.outputs.score - torch.sigmoid(logits)[0].item()) < TOL
    # N:N pairs the i-th with the i-th
    nn = llm.score([QUERY, DOCUMENTS[1]], [DOCUMENTS[0], QUERY])
    assert abs(nn[0].outputs.score - outs[0].outputs.score) < 1e-6
    assert nn[1].prompt_token_ids == hf_tok(DOCUMENTS[1], text_pair=QUERY)["input_ids"]
    with pytest.raises(ScoringError, match="1:1, 1:N or N:N"):
        llm.score([QUERY, QUERY], DOCUMENTS)


def test_an_embedding_model_scores_by_cosine(causal_lm: Path) -> None:
    llm = _llm(causal_lm)
    model = transformers.AutoModel.from_pretrained(causal_lm, dtype=torch.float32).eval()
    tok = Tokenizer.from_pretrained(causal_lm)
    with torch.no_grad():
        states = {
            t: model(torch.tensor([tok.encode(t)])).last_hidden_state[0, -1]
            for t in [QUERY, *DOCUMENTS]
        }
    outs = llm.score(QUERY, DOCUMENTS)
    for out, doc in zip(outs, DOCUMENTS, strict=True):
        want = torch.nn.functional.cosine_similarity(states[QUERY], states[doc], dim=0).item()
        assert abs(out.outputs.score - want) < TOL
        assert out.prompt_token_ids == tok.encode(QUERY) + tok.encode(doc)


def test_pair_template_is_the_tokenizers(causal_lm: Path) -> None:
    """make_tiny's tokenizer puts a BOS before each text of a pair; join_pair places it as
    transformers does, and a tokenizer without a pair template concatenates."""
    tok = Tokenizer.from_pretrained(causal_lm)
    hf_tok = transformers.AutoTokenizer.from_pretrained(causal_lm)
    for a, b in [(QUERY, DOCUMENTS[0]), ("x", "y z")]:
        joined = tok.join_pair(tok.encode(a, False), tok.encode(b, False))
        assert joined == hf_tok(a, text_pair=b)["input_ids"]
    assert joined.count(0) == 2  # <|begin_of_text|> opens both texts


def test_pair_separator_off_concatenates_the_texts(cross_encoder: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "no-sep"
    shutil.copytree(cross_encoder, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "use_sep_token": False}))
    (ckpt / "kvrelay-identity.json").unlink()
    llm = _llm(ckpt)
    tok = Tokenizer.from_pretrained(ckpt)
    (out,) = llm.score(QUERY, DOCUMENTS[0])
    assert out.prompt_token_ids == tok.encode(QUERY + DOCUMENTS[0])


def test_classifier_config_follows_config_json() -> None:
    arch = {"architectures": ["LlamaForSequenceClassification"]}
    assert ClassifierConfig.from_hf({"architectures": ["LlamaForCausalLM"]}) is None
    two = ClassifierConfig.from_hf({**arch, "id2label": {"1": "yes", "0": "no"}})
    assert two == ClassifierConfig(("no", "yes"), "softmax", True)
    one = ClassifierConfig.from_hf({**arch, "num_labels": 1, "use_sep_token": False})
    assert one == ClassifierConfig(("LABEL_0",), "sigmoid", False) and one.scores_pairs
    assert ClassifierConfig.from_hf({**arch, "problem_type": "regression"}).activation == (
        "identity"
    )
    multi = {**arch, "problem_type": "multi_label_classification"}
    assert ClassifierConfig.from_hf(multi).activation == "sigmoid"
    st = {**arch, "num_labels": 1, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}  # fmt: skip
    assert ClassifierConfig.from_hf(st).activation == "identity"
    with pytest.raises(PoolingConfigError, match=r"activation 'os\.system'"):
        ClassifierConfig.from_hf({**arch, "sbert_ce_default_activation_function": "os.system"})
    with pytest.raises(PoolingConfigError, match=r"0\.\.N-1"):
        ClassifierConfig.from_hf({**arch, "id2label": {"0": "a", "2": "c"}})


def test_pair_indices() -> None:
    assert pair_indices(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert pair_indices(2, 2) == [(0, 0), (1, 1)]
    with pytest.raises(ScoringError, match="at least one"):
        pair_indices(1, 0)


def test_refusals(causal_lm: Path, three_labels: Path, cross_encoder: Path) -> None:
    llm = _llm(three_labels)
    with pytest.raises(RequestError, match="classifies and scores only") as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert info.value.param == "model"
    with pytest.raises(RequestError, match="not embed"):
        llm.embed(["hello"])
    with pytest.raises(RequestError, match="'dimensions' applies to embeddings") as info:
        llm.classify([[5, 6]], PoolingParams(dimensions=2))
    assert info.value.param == "dimensions"
    with pytest.raises(ScoringError, match="into 3 labels"):
        llm.score(QUERY, DOCUMENTS)
    with pytest.raises(RequestError, match="needs a sequence classifier"):
        _llm(causal_lm).classify(["hello"])
    # a head whose shape the config does not match is named
    bad = three_labels.parent / "bad-head"
    shutil.copytree(cross_encoder, bad, dirs_exist_ok=True)
    config = json.loads((bad / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "kvrelay-identity.json").unlink()
    with pytest.raises(CheckpointError, match=r"score.weight is \[1, 128\]"):
        _llm(bad)
