"""vLLM's request ``priority`` under ``--scheduling-policy priority``: the offline engine and
a cluster of real processes, where an urgent request takes the only seat from a long stream
of lower priority; under the default policy (fcfs) a priority is a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.cli.launcher import Launcher
from kvrelay.engine.admission import RequestError
from tests.cluster_harness import TOPOLOGIES, metric_value, read_text, running_cluster

PROMPT = "The quick brown fox"


def test_the_offline_engine_takes_a_priority_only_under_the_priority_policy(
    tiny_model_dir: Path,
) -> None:
    fcfs = LLM(tiny_model_dir, num_blocks=64)
    with pytest.raises(RequestError, match="--scheduling-policy priority") as caught:
        fcfs.generate(PROMPT, SamplingParams(max_tokens=2, priority=1))
    assert caught.value.param == "priority"
    by_priority = LLM(tiny_model_dir, num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    params = [SamplingParams(temperature=0, max_tokens=3, priority=p) for p in (2, -1, 0)]
    outputs = by_priority.generate([PROMPT] * 3, params)
    alone = fcfs.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0]
    assert all(o.outputs[0].token_ids == alone.outputs[0].token_ids for o in outputs)


@pytest.fixture(scope="module", params=["colocated", "1P+1D"])
def by_priority(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One seat a worker; 1P+1D: the decode worker preempts for a more urgent hand-off."""
    args = ("--num-blocks", "512", "--threads", "1", "--max-num-seqs", "1")
    counts = TOPOLOGIES[request.param]
    with running_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("priority"), **counts,
        worker_args=(*args, "--scheduling-policy", "priority"),
    ) as launcher:  # fmt: skip
        yield launcher


def _client(launcher: Launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.timeout(180)
def test_an_urgent_request_takes_the_only_seat_from_a_long_stream(by_priority: Any) -> None:
    """One seat: a stream of 2,000 tokens at priority 5 holds it; a request at priority -1
    finishes while the stream is still running (preempted, then resumed from its tokens),
    and the stream still gets every token it asked for."""
    client = _client(by_priority)
    stream = client.completions.create(
        model="tiny", prompt="A long story:", max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True, "priority": 5},
    )  # fmt: skip
    chunks = iter(stream)
    # 1P+1D: the first token comes from prefill, later ones from decode; waiting for the
    # third makes sure the stream holds the decode seat (else a more urgent hand-off, queued
    # in priority order beside it, would simply go first and preempt nothing)
    text = "".join(next(chunks).choices[0].text for _ in range(3))
    urgent = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "priority": -1},
    )  # fmt: skip
    assert urgent.usage is not None and urgent.usage.completion_tokens == 4
    finish = None
    for chunk in chunks:  # the stream was not done when the urgent request was
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    instances = by_priority.get_json("/admin/instances")["data"]
    (streaming,) = [i for i in instances if i["role"] in ("colocated", "decode")]
    worker = streaming["status_url"].rstrip("/") + "/metrics"
    assert metric_value(read_text(worker), "kvrelay_num_preemptions_total") >= 1


def test_under_fcfs_a_priority_is_a_400_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=1, num_decode=1) as launcher:
        with pytest.raises(openai.BadRequestError) as caught:
            _client(launcher).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"priority": 3}
            )
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == "priority"
        assert "--scheduling-policy priority" in body["message"]
        ok = _client(launcher).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"priority": 0}
        )
        assert ok.usage is not None and ok.usage.completion_tokens >= 1
