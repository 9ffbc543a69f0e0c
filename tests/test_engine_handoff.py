"""Engine-level KV hand-off: prefill detaches with its blocks held, decode imports them.

The same greedy tokens as one engine doing everything; no block leaks on either side. A
pull between different hand-off versions is refused before any copy.
"""

from __future__ import annotations

import dataclasses as dc

import msgpack
import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.engine.admission import RequestError
from kvrelay.engine.engine import LLMEngine
from kvrelay.protocol import messages
from kvrelay.protocol.errors import VersionMismatch
from kvrelay.protocol.messages import (
    KV_HANDOFF_VERSION,
    WIRE_TYPES,
    KvLayout,
    PeerInfo,
    Role,
    decode,
    encode,
)
from kvrelay.transport.base import PullSpec, check_pull

PROMPTS = [
    "The cache moves to the decode worker",
    "a",
    "Prefill computes the prompt; decode continues it token by token. " * 4,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _handoff(prefill: LLMEngine, decode: LLMEngine, req_id: str) -> None:
    seq = prefill.detach_request(req_id)
    assert seq is not None
    blocks = decode.block_manager.take_blocks(len(seq.block_ids))
    assert blocks is not None
    decode.runner.kv_cache[:, :, blocks] = prefill.runner.kv_cache[:, :, seq.block_ids]
    prefill.block_manager.release(seq.block_ids)
    decode.import_request(
        req_id,
        seq.prompt_token_ids,
        seq.output_token_ids,
        seq.params,
        blocks,
        seq.num_cached_tokens,
    )


def test_detach_and_import_give_the_colocated_tokens(tiny_model_dir):
    expected = [
        o.outputs[0].token_ids for o in LLM(tiny_model_dir, num_blocks=64).generate(PROMPTS, GREEDY)
    ]
    prefill = LLMEngine.from_args(tiny_model_dir, num_blocks=64)
    decode = LLMEngine.from_args(tiny_model_dir, num_blocks=48)
    tok = prefill.tokenizer
    assert tok is not None
    for i, text in enumerate(PROMPTS):
        prefill.add_request(str(i), tok.encode(text), GREEDY)
    first: dict[str, int] = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first[out.request_id] = out.new_token_ids[0]
            _handoff(prefill, decode, out.request_id)
    tokens: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id] = out.token_ids
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == expected
    assert [first[str(i)] for i in range(len(PROMPTS))] == [t[0] for t in expected]
    for engine in (prefill, decode):
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_leaked() == 0


def test_resume_after_streamed_tokens_continues_the_same_text(tiny_model_dir):
    llm = LLM(tiny_model_dir)
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[0])
    full = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("resume", prompt, GREEDY, output_token_ids=full[:5])
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.token_ids
    assert out == full
    assert engine.block_manager.num_leaked() == 0


def test_import_with_the_wrong_block_count_is_refused(tiny_model_dir):
    engine = LLMEngine.from_args(tiny_model_dir, num_blocks=16)
    blocks = engine.block_manager.take_blocks(1)
    assert blocks is not None
    with pytest.raises(RequestError, match="expected 2"):
        engine.import_request("x", list(range(20)), [5], GREEDY, blocks)
    engine.block_manager.release(blocks)
    assert engine.block_manager.num_leaked() == 0


def test_a_pull_between_hand_off_versions_is_refused_before_any_copy():
    """A source from an older kvrelay (no ``kv_version``: version 1) is refused with the
    reason, not after a copy with a checksum mismatch; its PeerInfo still decodes."""
    layout = KvLayout(2, 8, 4, 1, 4, "float32")
    info = PeerInfo("p", Role.PREFILL, "h", "tcp://x:1", "", None, layout, b"f")
    assert decode(encode(info)) == info and KV_HANDOFF_VERSION == 2
    values = [getattr(info, f.name) for f in dc.fields(PeerInfo)][:-1]
    ext = msgpack.ExtType(
        1, msgpack.packb([WIRE_TYPES.index(PeerInfo), *values], default=messages._default)
    )
    old = decode(msgpack.packb(ext))
    assert old == dc.replace(info, kv_version=1)
    pool = torch.zeros(2, 2, 8, 4, 1, 4)
    check_pull(PullSpec("r", info, [0, 1], 0, 1e12), pool, [2, 3], layout, b"f")  # same: fine
    with pytest.raises(VersionMismatch, match="version 1, this instance 2"):
        check_pull(PullSpec("r", old, [0, 1], 0, 1e12), pool, [2, 3], layout, b"f")
