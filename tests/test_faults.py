"""Faults with real processes: dead workers, corrupted transfers, expired leases.

Every case still returns the offline engine's greedy text, and afterwards every surviving
worker reports zero used or leaked blocks and no shared-memory segment remains.
"""

from __future__ import annotations

import concurrent.futures
import signal

import openai
import pytest

from kvrelay import LLM
from tests.cluster_harness import (
    STREAM_PROMPT,
    STREAM_TOKENS,
    TOPOLOGIES,
    decode_running,
    metric_value,
    read_text,
    running_cluster,
    worker_stats,
)


def _client(launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)


def _request(c: openai.OpenAI, max_tokens: int = STREAM_TOKENS, **kw):
    return c.completions.create(
        model="tiny",
        prompt=STREAM_PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_decode_killed_mid_stream_finishes_on_the_other(tiny_model_dir, tmp_path, stream_reference):
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=1, num_decode=2) as launcher:
        stream = _request(_client(launcher), stream=True)
        parts, victim = [], None
        for chunk in stream:
            parts.append(chunk.choices[0].text)
            if victim is None and len(parts) == 5:
                victim = decode_running(launcher)
                launcher.kill(victim, signal.SIGKILL)
        assert victim is not None
        assert "".join(parts) == stream_reference
        metrics = read_text(launcher.url + "/metrics")
        assert metric_value(metrics, "kvrelay_request_retries_total") >= 1


def test_prefill_killed_requests_are_retried(tiny_model_dir, tmp_path, stream_reference):
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=2, num_decode=1) as launcher:
        launcher.kill("prefill-0", signal.SIGKILL)  # the router has not noticed yet
        c = _client(launcher)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: _request(c, max_tokens=32), range(4)))
        assert [r.choices[0].text for r in results] == [
            stream_reference[: len(results[0].choices[0].text)]
        ] * 4
        assert all(r.usage.completion_tokens == 32 for r in results)
        metrics = read_text(launcher.url + "/metrics")
        assert metric_value(metrics, "kvrelay_request_retries_total") >= 1
        joined = {d["instance_id"] for d in launcher.get_json("/admin/instances")["data"]}
        assert "prefill-0" not in joined


def test_corrupted_transfer_is_detected_and_recomputed(tiny_model_dir, tmp_path, stream_reference):
    args = ("--num-blocks", "512", "--threads", "1", "--corrupt-transfers", "1")
    with running_cluster(tiny_model_dir, tmp_path, worker_args=args) as launcher:
        c = _client(launcher)
        first = _request(c, max_tokens=48)
        second = _request(c, max_tokens=48)
        assert first.choices[0].text == second.choices[0].text
        assert stream_reference.startswith(first.choices[0].text)
        decode = worker_stats(launcher)["decode-0"]
        assert decode["num_recomputed"] == 1
        inst = {d["instance_id"]: d for d in launcher.get_json("/admin/instances")["data"]}
        metrics = read_text(inst["decode-0"]["status_url"] + "/metrics")
        failures = metric_value(
            metrics, "kvrelay_kv_transfer_failures_total", reason="ChecksumMismatch"
        )
        assert failures == 1


def test_expired_lease_frees_both_sides(tiny_model_dir, tmp_path, stream_reference):
    args = ("--num-blocks", "512", "--threads", "1", "--lease-ttl", "0")
    with running_cluster(tiny_model_dir, tmp_path, worker_args=args) as launcher:
        res = _request(_client(launcher), max_tokens=40)
        assert stream_reference.startswith(res.choices[0].text)
        assert res.usage.completion_tokens == 40
        assert worker_stats(launcher)["decode-0"]["num_recomputed"] == 1


def test_no_survivor_ends_the_stream_with_an_error_event(tiny_model_dir, tmp_path):
    spec = TOPOLOGIES["colocated"]
    with running_cluster(tiny_model_dir, tmp_path, check_leaks=False, **spec) as launcher:
        stream = _request(_client(launcher), stream=True)
        received = 0
        with pytest.raises(openai.APIError, match="broke off"):
            for _ in stream:
                received += 1
                if received == 3:
                    launcher.kill("colocated-0", signal.SIGKILL)
        assert received >= 3
        assert launcher.get_json("/admin/instances")["num_inflight"] == 0


def test_restarted_router_gets_the_workers_back(tiny_model_dir, tmp_path, stream_reference):
    with running_cluster(tiny_model_dir, tmp_path) as launcher:
        launcher.kill("router", signal.SIGKILL)
        launcher.start_router()
        launcher.wait_ready(timeout=60)  # workers re-register when their heartbeats go unknown
        res = _request(_client(launcher), max_tokens=16)
        assert stream_reference.startswith(res.choices[0].text)
        assert res.usage.completion_tokens == 16


def test_embeddings_on_a_killed_prefill_are_re_run(tiny_model_dir, tmp_path):
    """A batch of embedding inputs, some placed on a prefill worker that died before the
    router noticed: every input is re-run on the survivor, and the vectors are the offline
    engine's."""
    import numpy as np

    inputs = [[5 + i, 6, 7, 8] * (4 + i) for i in range(16)]
    want = [o.outputs.embedding for o in LLM(tiny_model_dir, warm_up=False).embed(inputs)]
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=2, num_decode=1) as launcher:
        launcher.kill("prefill-0", signal.SIGKILL)  # the router has not noticed yet
        got = _client(launcher).embeddings.create(model="tiny", input=inputs)
        assert len(got.data) == len(inputs)
        for d, w in zip(got.data, want, strict=True):
            assert np.allclose(d.embedding, w, atol=1e-5)
        metrics = read_text(launcher.url + "/metrics")
        assert metric_value(metrics, "kvrelay_request_retries_total") >= 1
