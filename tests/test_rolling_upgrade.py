"""A rolling upgrade, router first: a worker older than a sampling field never runs a request
that sets it.

The codec drops a newer sender's trailing fields, so an old worker would run a request with
``logit_bias`` (or ``cache_salt``, a grammar, ...) as if it had none. A real cluster (router
and a colocated worker of this version) is joined by a member that registers as a worker of
the first wire format does (its ``Register`` without ``sampling_fields``), holding the real
secret, and answers each request it gets with one token. Requests that set a later field go to
the new worker only, and with the new worker drained they are refused, naming the field;
plain requests still reach the old member. Embeddings, likewise, go only to a worker that
registered an embedding size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import zmq

from kvrelay.cli.launcher import Launcher
from kvrelay.protocol.messages import (
    GenerateRequest,
    LoadReport,
    RegisterAck,
    Role,
    TokenEvent,
    decode,
    encode,
)
from kvrelay.protocol.sampling_params import REQUEST_NAMES
from tests.cluster_harness import admin_request, running_cluster
from tests.test_placement import old_register_bytes
from tests.test_trust import peer_info, rogue_socket

OLD_ID = "old-worker"
OLD_TOKEN = 5  # the one token the old member answers with
BIASED = 7  # logit_bias +100 makes greedy decoding pick it every time


class OldWorker:
    """A cluster member speaking the first wire format's ``Register``: it records every
    ``GenerateRequest`` and finishes it with ``OLD_TOKEN``. Its thread owns the socket."""

    def __init__(self, launcher: Launcher) -> None:
        self.ctx = zmq.Context()
        self.sock = rogue_socket(self.ctx, "member", launcher, launcher.control_addr)
        self.requests: list[GenerateRequest] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _register(self) -> None:
        self.sock.send(old_register_bytes(peer_info(OLD_ID, Role.COLOCATED), pid=4242))

    def _run(self) -> None:
        self._register()
        next_beat = 0.0
        while not self.stop.is_set():
            if time.monotonic() >= next_beat:
                self.sock.send(encode(LoadReport(OLD_ID, 0, 0, 4096, 4096)))
                next_beat = time.monotonic() + 0.1
            if not self.sock.poll(50):
                continue
            msg = decode(self.sock.recv())
            if isinstance(msg, RegisterAck) and not msg.known:
                self._register()
            elif isinstance(msg, GenerateRequest):
                self.requests.append(msg)
                logprobs = None if msg.params.logprobs is None else [[OLD_TOKEN, -1.0, 1, []]]
                done = TokenEvent(
                    msg.request_id, OLD_ID, [OLD_TOKEN], 0, logprobs, finished=True,
                    finish_reason="length", attempt=msg.attempt,
                )  # fmt: skip
                self.sock.send(encode(done))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def launcher(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    log_dir = tmp_path_factory.mktemp("upgrade-logs")
    with running_cluster(tiny_model_dir, log_dir, num_prefill=0, num_decode=0, num_colocated=1) as (
        launcher
    ):
        yield launcher


@pytest.fixture
def old(launcher: Launcher) -> Iterator[OldWorker]:
    worker = OldWorker(launcher)
    try:
        deadline = time.monotonic() + 10
        while OLD_ID not in (launcher.joined_instances() or ()):
            assert time.monotonic() < deadline, "the old worker never joined"
            time.sleep(0.1)
        yield worker
    finally:
        worker.close()
        deadline = time.monotonic() + 10  # silent now: reaped before the leak check
        while OLD_ID in (launcher.joined_instances() or ()) and time.monotonic() < deadline:
            time.sleep(0.1)


def _instances(launcher: Launcher) -> dict[str, dict[str, Any]]:
    return {d["instance_id"]: d for d in launcher.get_json("/admin/instances")["data"]}


def _client(launcher: Launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)


def _complete(launcher: Launcher, max_tokens: int = 1, **extra: Any) -> list[int]:
    res = _client(launcher).completions.create(
        model="tiny", prompt="An upgrade rolls through the cluster and", max_tokens=max_tokens,
        temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
    )  # fmt: skip
    return [int(t.removeprefix("token_id:")) for t in res.choices[0].logprobs.tokens]


NEWER_FIELDS: dict[str, dict[str, Any]] = {
    "logit_bias": {"logit_bias": {str(BIASED): 100}},
    "cache_salt": {"cache_salt": "tenant-a"},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "allowed_token_ids": {"allowed_token_ids": [BIASED, 8]},
    "structured_outputs": {"structured_outputs": {"regex": "[ab]+"}, "ignore_eos": False},
    "bad_words": {"bad_words": ["zebra"]},
    "priority": {"priority": 1},
}


@pytest.mark.timeout(180)
def test_an_old_worker_gets_no_request_with_a_field_it_would_drop(
    launcher: Launcher, old: OldWorker
) -> None:
    instances = _instances(launcher)
    (new_id,) = [i for i, d in instances.items() if i != OLD_ID]
    assert instances[new_id]["unknown_sampling_fields"] == []
    unknown = {REQUEST_NAMES.get(f, f) for f in instances[OLD_ID]["unknown_sampling_fields"]}
    # and lora_name, which a request sets by naming an adapter as its model: only workers
    # that registered the adapter get those (tests/test_lora_serving.py)
    assert unknown == {*NEWER_FIELDS, "model"}

    # both placeable, the new one busy with a stream: a plain request takes the idle old
    # worker, a biased one waits its turn on the new worker and is biased
    stream = _client(launcher).completions.create(
        model="tiny", prompt="A long stream holds the new worker", max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    try:
        chunks = iter(stream)
        next(chunks)
        assert len(old.requests) == 0  # the stream runs on the new worker
        deadline = time.monotonic() + 10  # and its reports say so (placement reads them)
        while _instances(launcher)[new_id]["num_running"] < 1:
            assert time.monotonic() < deadline, "the stream never showed in a report"
            time.sleep(0.05)
        assert _complete(launcher) == [OLD_TOKEN]
        assert len(old.requests) == 1
        assert _complete(launcher, max_tokens=4, **NEWER_FIELDS["logit_bias"]) == [BIASED] * 4
        assert len(old.requests) == 1
        # an embedding: only a worker that registered an embedding size pools
        vector = _client(launcher).embeddings.create(model="tiny", input="hi").data[0]
        assert len(vector.embedding) == instances[new_id]["embedding_size"] > 0
        assert instances[OLD_ID]["embedding_size"] == 0
        assert len(old.requests) == 1
    finally:
        stream.close()

    # the new worker drained: plain requests run on the old one, newer fields are refused
    assert admin_request(launcher, f"/admin/instances/{new_id}/drain")[0] == 200
    try:
        assert _complete(launcher) == [OLD_TOKEN]
        assert len(old.requests) == 2
        for field, extra in NEWER_FIELDS.items():
            with pytest.raises(openai.BadRequestError) as caught:
                _complete(launcher, **extra)
            error = caught.value.body
            assert isinstance(error, dict)
            assert error["param"] == field, error
            assert "older kvrelay than the router" in error["message"]
        with pytest.raises(openai.BadRequestError, match="older kvrelay than the router"):
            _client(launcher).embeddings.create(model="tiny", input="hi")
        assert len(old.requests) == 2
    finally:
        assert admin_request(launcher, f"/admin/instances/{new_id}/undrain")[0] == 200

    assert all(not r.params.fields_set() for r in old.requests)
