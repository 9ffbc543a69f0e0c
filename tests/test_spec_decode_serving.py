"""Speculative decoding in a cluster of real processes (``--speculative-config`` on the
workers): completions, streamed or not, give the tokens of the offline engine without drafts;
streamed chunks carry several tokens a step; the decode side counts drafts and accepted
tokens in its metrics; and nothing leaks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.cli.launcher import Launcher
from tests.cluster_harness import (
    TOPOLOGIES,
    assert_no_leaks,
    metric_value,
    read_text,
    running_cluster,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8, 9, 10] * 6, [300 + i % 7 for i in range(50)]]
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=["colocated", "1P+1D"])
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launcher]:
    counts = TOPOLOGIES[request.param]
    worker_args = (
        "--num-blocks", "512", "--threads", "1", "--speculative-config", json.dumps(SPEC),
    )  # fmt: skip
    with running_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("spec-cluster"), worker_args=worker_args,
        **counts,
    ) as launcher:  # fmt: skip
        yield launcher


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> list[list[int]]:
    """Greedy token ids of PROMPTS from the offline engine without drafts."""
    llm = LLM(tiny_model_dir, warm_up=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def _completion(launcher: Launcher, prompt: list[int], stream: bool) -> list[list[int]]:
    """The token ids of a greedy completion, as the chunks carried them (one list)."""
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)
    kwargs: dict[str, Any] = {
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True},
    }  # fmt: skip
    if not stream:
        tokens = client.completions.create(**kwargs).choices[0].logprobs.tokens
        return [[int(t.removeprefix("token_id:")) for t in tokens]]
    chunks = []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
            chunks.append(
                [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
            )
    return chunks


def _decode_metrics(launcher: Launcher) -> tuple[float, float]:
    """Draft tokens and accepted ones over the workers that decode."""
    drafted = accepted = 0.0
    for inst in launcher.get_json("/admin/instances")["data"]:
        if inst["role"] == "prefill":
            continue
        text = read_text(inst["status_url"] + "/metrics")
        drafted += metric_value(text, "kvrelay_spec_decode_num_draft_tokens_total")
        accepted += metric_value(text, "kvrelay_spec_decode_num_accepted_tokens_total")
    return drafted, accepted


@pytest.mark.timeout(180)
def test_completions_equal_the_engine_without_drafts(cluster: Launcher, offline) -> None:
    several = 0
    for prompt, want in zip(PROMPTS, offline, strict=True):
        assert _completion(cluster, prompt, stream=False) == [want]
        chunks = _completion(cluster, prompt, stream=True)
        assert [t for chunk in chunks for t in chunk] == want
        several += sum(len(chunk) > 1 for chunk in chunks)
    assert several  # steps that kept drafts stream their tokens together
    deadline = time.monotonic() + 20  # the counters reach /metrics with a heartbeat
    while _decode_metrics(cluster)[1] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    drafted, accepted = _decode_metrics(cluster)
    assert 0 < accepted <= drafted
    chat = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    reply = chat.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi hi hi hi"}], max_tokens=12
    )
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 12
    assert_no_leaks(cluster)


def test_kvrelay_up_passes_the_setting_and_refuses_a_bad_one(tiny_model_dir: Path) -> None:
    from kvrelay.cli import build_parser
    from kvrelay.cli.engine_args import engine_cli_args

    args = build_parser().parse_args(
        ["up", "--model", str(tiny_model_dir), "--speculative-config", json.dumps(SPEC)]
    )
    words = engine_cli_args(args)
    passed = json.loads(words[words.index("--speculative-config") + 1])
    assert passed["num_speculative_tokens"] == 4 and passed["prompt_lookup_min"] == 1
    bad = subprocess.run(
        [sys.executable, "-m", "kvrelay", "up", "--model", str(tiny_model_dir),
         "--speculative-config", '{"method": "eagle3"}'],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "'eagle3' is not supported" in bad.stderr
