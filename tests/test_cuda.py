"""The engine and the cluster on a CUDA device; the tests that need one skip without it.

What runs on the GPU: weights (from disk or from the host's parameter pool), the paged KV
pool, attention, sampling (seeded generators live on the device), the L1 offload and load
(device <-> host shared memory), and the KV hand-off between a prefill and a decode process
over CUDA IPC (same GPU) or tcp (host staging). Each generated token is checked against a
float32 CPU reference (transformers) run over the same tokens: a GPU kernel's rounding may
differ from the CPU's, but the token it picks must be the reference's argmax within
``LOGIT_TOL``. Cluster outputs must equal the offline engine's on the same device exactly:
the hand-off moves bytes, it must not change a single one. The device checks (names, the
error without CUDA) and the gather / scatter helpers the GPU paths use run everywhere.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.engine.config import ConfigError
from kvrelay.engine.engine import LLMEngine, build_engine_config
from kvrelay.text.tokenizer import Tokenizer
from tests.cluster_harness import metric_value, read_text, running_cluster, worker_stats

NO_CUDA = "needs a CUDA device (runs where one is present)"


def needs_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test ``gpu`` and skips it, saying why, where torch sees no CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)(test))


LOGIT_TOL = 2e-3  # float32 logits of the tiny model: CUDA vs CPU kernels differ by ~1e-5
MAX_TOKENS = 16
PROMPTS = [
    "The cache moves to the decode worker",
    "a",
    "Prefill computes the prompt; decode continues it token by token. " * 6,
    "数据在两个进程之间移动 🚀",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """float32 logits of every position, on CPU, from transformers (the parity reference)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()

    def logits(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float()

    return logits


def assert_greedy_under_reference(reference, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Each output token is the reference's argmax at its position, within LOGIT_TOL."""
    assert len(output_ids) == MAX_TOKENS
    logits = reference(prompt_ids + output_ids[:-1])
    for step, token in enumerate(output_ids):
        row = logits[len(prompt_ids) - 1 + step]
        gap = float(row.max() - row[token])
        assert gap <= LOGIT_TOL, f"step {step}: token {token} is {gap:.2e} below the argmax"


def test_cuda_device_is_refused_without_cuda(tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("checks the error on machines without CUDA")
    with pytest.raises(ConfigError, match="no CUDA device"):
        LLM(tiny_model_dir, device="cuda", num_blocks=16)


def test_bad_device_names_are_refused(tiny_model_dir):
    for bad in ("gpu", "cuda:x", "CUDA", "cpu:0"):
        with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
            build_engine_config(str(tiny_model_dir), device=bad)


@needs_cuda
def test_engine_on_cuda_follows_the_reference(tiny_model_dir, reference):
    # a small chunk budget: prompts prefill in chunks, and decode groups mix context lengths
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=128, max_num_batched_tokens=48)
    assert llm.engine.runner.kv_cache.is_cuda
    graphs = llm.engine.runner.graphs  # the warm-up captured every decode batch size
    assert graphs is not None and set(graphs.graphs) == set(graphs.sizes)
    assert all(w.is_cuda for w in llm.engine.runner.model.weights.values())
    outputs = llm.generate(PROMPTS, GREEDY)
    for out in outputs:
        assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
    again = llm.generate(PROMPTS, GREEDY)  # the prompts' blocks are cached on the device now
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert again[2].num_cached_tokens > 0
    llm.engine.block_manager.check_integrity()


@needs_cuda
def test_decode_steps_replay_cuda_graphs_and_follow_the_reference(
    tiny_model_dir, reference, monkeypatch
):
    """Graphs padded to 4, 2 and 1 sequences; the eager Triton path and the torch path too:
    every greedy token of each is the reference's argmax within LOGIT_TOL."""
    lengths = [MAX_TOKENS, MAX_TOKENS - 4, MAX_TOKENS - 9]  # 3 sequences, then 2, then 1
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]

    def run(**env: str) -> LLM:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        llm = LLM(tiny_model_dir, device="cuda", num_blocks=128, warm_up=False)
        for out, n in zip(llm.generate(PROMPTS[:3], params), lengths, strict=True):
            ids, output = out.prompt_token_ids, out.outputs[0].token_ids
            assert len(output) == n
            logits = reference(ids + output[:-1])
            for step, token in enumerate(output):
                row = logits[len(ids) - 1 + step]
                assert float(row.max() - row[token]) <= LOGIT_TOL, (env, step)
        llm.engine.block_manager.check_integrity()
        return llm

    graphs = run().engine.runner.graphs
    assert graphs is not None
    assert {4, 2, 1} <= set(graphs.graphs) and graphs.replays >= MAX_TOKENS - 1
    eager = run(KVRELAY_CUDA_GRAPHS="0").engine.runner
    assert eager.graphs is None and eager.native_attention
    torch_path = run(KVRELAY_NATIVE_ATTENTION="0").engine.runner
    assert torch_path.graphs is None and not torch_path.native_attention


@needs_cuda
def test_warm_up_captures_every_decode_size_and_serving_only_replays(tiny_model_dir, reference):
    """The engine's warm-up (``capture_all``) leaves a graph for every padded batch size;
    serving afterwards replays them, captures nothing new, and follows the reference."""
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=256)  # warm_up=True: a worker's start
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    assert set(graphs.graphs) == set(graphs.sizes)
    captured, replays = dict(graphs.graphs), graphs.replays
    for out in llm.generate(PROMPTS, GREEDY):
        assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
    assert all(graphs.graphs[size] is graph for size, graph in captured.items())
    assert len(graphs.graphs) == len(captured)
    assert graphs.replays >= replays + MAX_TOKENS - 1
    llm.engine.block_manager.check_integrity()


@needs_cuda
def test_graph_capture_tolerates_another_thread_copying(tiny_model_dir, reference):
    """A worker's transport threads copy KV (host <-> device, on their own streams) while the
    warm-up captures: ``thread_local`` capture leaves them alone and the graphs still hold."""
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=256, warm_up=False)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not graphs.graphs
    host = torch.randn(1 << 18)
    device_buf = torch.empty(1 << 18, device="cuda")
    stop, errors, copies = threading.Event(), [], [0]

    def copier() -> None:
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    device_buf.copy_(host)  # pageable: a synchronous copy, unsafe in a capture
                    host.copy_(device_buf)
                    stream.synchronize()
                    copies[0] += 1
        except Exception as exc:  # reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=copier, daemon=True)
    thread.start()
    try:
        while copies[0] == 0 and not errors:  # the copier is running before the first capture
            stop.wait(0.01)
        before = copies[0]
        graphs.capture_all()
        during = copies[0] - before
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors
    assert during > 0  # copies went on while the graphs were captured
    assert set(graphs.graphs) == set(graphs.sizes)
    for out in llm.generate(PROMPTS, GREEDY):
        assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
    assert graphs.replays >= MAX_TOKENS - 1


def compiled_triton_variants() -> int:
    """Variants of kvrelay's Triton kernels compiled in this process so far, every device."""
    from kvrelay.kernels import triton_attention as ta

    k = ta._kernels()  # the kernels' module, imported at the first launch
    kernels = (k.decode_kernel, k.combine_kernel, k.store_kernel, k.prefill_kernel)
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


def compiled_prefill_variants() -> int:
    from kvrelay.kernels import triton_attention as ta

    return sum(len(caches[0]) for caches in ta._kernels().prefill_kernel.device_caches.values())


@needs_cuda
def test_serving_after_the_warm_up_compiles_no_kernel(tiny_model_dir):
    """Prompts of 5-400 tokens join running requests one by one (mixed steps of 1-80 decode
    rows, block tables of every width, prefill tiles from position 0 and mid-prompt, 1 to
    many a step) after the warm-up: Triton compiles nothing more, the prefill kernel included
    (a compile mid-serving stalled every running sequence for 0.5-1.4 s on an H100)."""
    llm = LLM(
        tiny_model_dir, device="cuda", num_blocks=2048, max_num_seqs=96, max_num_batched_tokens=256
    )
    engine, before = llm.engine, compiled_triton_variants()
    assert before > 0 and compiled_prefill_variants() > 0  # the warm-up compiled it
    steps = engine.runner.step_graphs  # and captured every token count's step
    assert steps is not None and set(steps.graphs) == set(steps.sizes)
    captured = dict(steps.graphs)
    assert engine.runner.prefill_tile_tokens > 0
    prefill_before = compiled_prefill_variants()
    rng, kinds, added = random.Random(0), [], 0
    while added < 80 or engine.has_unfinished_requests():
        if added < 80 and len(kinds) % 2 == 0:
            prompt = [rng.randrange(1, 2000) for _ in range(rng.randrange(5, 400))]
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(8, 90), ignore_eos=True
            )
            engine.add_request(f"r{added}", prompt, params)
            added += 1
        engine.step()
        kinds.append(engine.last_step_kind)
    assert kinds.count("mixed") >= 20 and kinds.count("decode") >= 20
    assert compiled_prefill_variants() == prefill_before
    assert compiled_triton_variants() == before
    assert steps.graphs == captured and steps.replays >= kinds.count("mixed")
    engine.block_manager.check_integrity()


LONG_PROMPT = PROMPTS[2] * 3  # 327 tokens of the tiny tokenizer: prefill tiles hold 64


@needs_cuda
@pytest.mark.parametrize("triton_prefill", ["1", "0"])
def test_prefill_on_cuda_is_one_launch_and_follows_the_reference(
    tiny_model_dir, reference, monkeypatch, triton_prefill
):
    """Prompts of 11-327 tokens in chunks of up to 160 beside running decodes: the runner
    builds one ``PrefillBatch`` a step (segments of several tiles, from position 0 and from
    the middle of a prompt) and no ``PrefillSegment``, and every greedy token is the
    reference's argmax within LOGIT_TOL. ``KVRELAY_TRITON_PREFILL=0``: segments through SDPA,
    the same check."""
    monkeypatch.setenv("KVRELAY_TRITON_PREFILL", triton_prefill)
    llm = LLM(
        tiny_model_dir, device="cuda", num_blocks=256, max_num_batched_tokens=160, warm_up=False
    )
    runner, metas = llm.engine.runner, []
    prepare = runner._prepare

    def recording(scheduled):
        prepared = prepare(scheduled)
        metas.append(prepared[2])
        return prepared

    monkeypatch.setattr(runner, "_prepare", recording)
    prompts = [LONG_PROMPT, PROMPTS[0], PROMPTS[2], PROMPTS[3] + LONG_PROMPT]
    for out in llm.generate(prompts, GREEDY):
        assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
    batches = [m.native_prefill for m in metas if m.native_prefill is not None]
    if triton_prefill == "0":
        assert not batches and any(m.prefills for m in metas)
        return
    assert batches and not any(m.prefills for m in metas)
    tiles = torch.cat([b.tiles.cpu() for b in batches])
    assert bool((tiles[:, 2] > 0).any()), "no segment started mid-prompt"
    assert bool((tiles[:, 1] == batches[0].tile_tokens).any()), "no segment filled a tile"
    assert any(b.tiles.shape[0] > 1 for b in batches)
    assert any(m.native_decode is not None and m.native_prefill is not None for m in metas)
    llm.engine.block_manager.check_integrity()


@needs_cuda
@pytest.mark.parametrize("path", ["step", "layer", "eager"])
def test_prompt_and_mixed_steps_replay_graphs_and_follow_the_reference(
    tiny_model_dir, reference, monkeypatch, path
):
    """The warm-up captures a graph of every padded token count up to the step budget: the
    whole step (``StepGraphs``, Triton's prefill), or with ``KVRELAY_TRITON_PREFILL=0`` the
    pieces around attention (``LayerGraphs``). Prompt and mixed steps (chunks of up to 160
    tokens beside decodes) replay them and capture nothing new; each replayed step's hidden
    states are the eager forward's over the same inputs, and every greedy token is the
    reference's argmax within LOGIT_TOL. ``KVRELAY_MIXED_GRAPHS=0``: neither, the same check."""
    from kvrelay.engine.engine import step_kind

    monkeypatch.setenv("KVRELAY_TRITON_PREFILL", "0" if path == "layer" else "1")
    monkeypatch.setenv("KVRELAY_MIXED_GRAPHS", "0" if path == "eager" else "1")
    prompts = [LONG_PROMPT, PROMPTS[0], PROMPTS[2], PROMPTS[3] + LONG_PROMPT]
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=256, max_num_batched_tokens=160)
    runner = llm.engine.runner
    graphs = {"step": runner.step_graphs, "layer": runner.layer_graphs}.get(path)
    assert (runner.step_graphs is not None) == (path == "step")
    assert (runner.layer_graphs is not None) == (path == "layer")
    if graphs is None:
        for out in llm.generate(prompts, GREEDY):
            assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
        return
    assert graphs.sizes[-1] == 192
    captured = dict(graphs.graphs if path == "step" else graphs.pieces)
    assert set(captured) == set(graphs.sizes)
    replays, kinds, padded = graphs.replays, [], []
    run, replay = runner.run, graphs.run

    def recording(plan):
        kinds.append(step_kind(plan))
        return run(plan)

    def checked(input_ids, positions, meta):
        got = replay(input_ids, positions, meta).clone()
        eager = runner.model.forward(input_ids, positions, runner.kv_cache, meta)  # same K/V
        torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-3)
        padded.append(input_ids.numel() not in graphs.sizes)
        return got

    monkeypatch.setattr(runner, "run", recording)
    monkeypatch.setattr(graphs, "run", checked)
    for out in llm.generate(prompts, GREEDY):
        assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
    assert {"prefill", "mixed"} <= set(kinds) and any(padded)
    assert graphs.replays - replays == len(padded) >= kinds.count("prefill") + kinds.count("mixed")
    assert captured == (graphs.graphs if path == "step" else graphs.pieces)
    llm.engine.block_manager.check_integrity()


@needs_cuda
def test_seeded_sampling_on_cuda_repeats(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=64)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate([PROMPTS[0]] * 2, params)
    second = llm.generate([PROMPTS[0]], params)
    ids = [o.outputs[0].token_ids for o in first + second]
    assert ids[0] == ids[1] == ids[2]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    draws = {tuple(o.outputs[0].token_ids) for o in llm.generate([PROMPTS[0]] * 4, unseeded)}
    assert len(draws) > 1  # the shared device generator moves on between rows


@needs_cuda
def test_sampler_on_cuda_picks_the_cpu_tokens_for_the_same_uniforms(monkeypatch):
    """Every sampling path (greedy, temperature, top-k / top-p / min-p on candidates and on
    whole sorted rows, min-p's threshold, penalties, min_tokens, logprobs) chooses on CUDA the
    token it chooses on the CPU when both draw the same uniform numbers. The vocabulary is
    SmolLM2's, so candidate filtering and the two-level inverse CDF both run; flat rows under
    top-p 0.999 fall back to the whole sort."""
    from kvrelay.engine import sampling

    vocab, rng = 49_152, random.Random(3)
    modes = [
        dict(temperature=0.0),
        dict(temperature=0.0, presence_penalty=0.5, logprobs=3),
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=50),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=1.3, top_p=0.999),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.8, top_k=200, top_p=0.8, min_p=0.02),
        dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4),
        dict(temperature=1.0, min_tokens=4, logprobs=5),
    ]
    requests, rows = [], []
    generator = torch.Generator().manual_seed(11)
    for i in range(40):
        params = SamplingParams(max_tokens=16, **modes[i % len(modes)])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        requests.append(sampling.SampleRequest(params, prompt, output, None))
        scale = 0.05 if i % 4 == 3 else 3.0  # flat rows: top-p 0.999 keeps most of the vocabulary
        rows.append(torch.randn(vocab, generator=generator) * scale)
    logits = torch.stack(rows)
    uniforms = torch.rand(len(requests), generator=generator, dtype=torch.float64)
    monkeypatch.setattr(
        sampling.Sampler, "_uniforms", lambda self, generators, device: uniforms.to(device)
    )
    on_cpu = sampling.Sampler(eos_token_ids=[2])(logits, requests)
    on_cuda = sampling.Sampler(eos_token_ids=[2])(logits.cuda(), requests)
    assert on_cuda.token_ids == on_cpu.token_ids
    for cpu_row, cuda_row in zip(on_cpu.logprobs, on_cuda.logprobs):
        assert (cpu_row is None) == (cuda_row is None)
        if cpu_row is not None and cuda_row is not None:
            assert cuda_row.token_id == cpu_row.token_id and cuda_row.rank == cpu_row.rank
            assert cuda_row.logprob == pytest.approx(cpu_row.logprob, abs=1e-4)
            assert [t for t, _ in cuda_row.top] == [t for t, _ in cpu_row.top]


@needs_cuda
def test_l1_host_pool_round_trip_from_a_cuda_pool(tiny_model_dir):
    """Engine A (GPU) offloads a prompt's blocks to host shared memory; engine B (GPU, empty
    device cache) loads them back and generates the same tokens from them."""
    from kvrelay.cachetier.base import BlockFormat
    from kvrelay.cachetier.host_ops import remove_host_pool
    from kvrelay.cachetier.host_pool import HostPool
    from kvrelay.cachetier.manager import TieredCache

    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.encode(PROMPTS[2])
    name = f"kvrelay-l1-test-cuda-{uuid.uuid4().hex[:8]}"
    engines = []
    try:
        config = build_engine_config(str(tiny_model_dir), device="cuda", num_blocks=64)
        mc = config.model_config
        fmt = BlockFormat(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, "float32")
        for _ in range(2):
            tiers = TieredCache([HostPool.open(name, 64 << 20, fmt)])
            engines.append(LLMEngine(config, tokenizer, tiers=tiers))
        outputs = []
        for engine in engines:
            engine.add_request("r", list(prompt), GREEDY)
            while engine.has_unfinished_requests():
                done = [o for o in engine.step() if o.finished]
                engine.flush_cache_events()  # A offloads its full blocks to L1 here
            outputs.append(done[0])
        assert outputs[1].cached_tokens_by_tier.get("host", 0) >= 16 * (len(prompt) // 16 - 1)
        assert outputs[1].token_ids == outputs[0].token_ids
    finally:
        for engine in engines:
            if engine.connector is not None:
                engine.connector.tiers.close()
        remove_host_pool(name, force=True)


def _client(launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)


@needs_cuda
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_1p1d_cluster_on_cuda_equals_the_offline_engine(tiny_model_dir, tmp_path, transport):
    """Prefill and decode processes on one GPU: auto picks CUDA IPC (device to device);
    tcp stages through host memory. The text equals the offline CUDA engine's."""
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=512)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]
    del llm
    worker_args = ("--num-blocks", "512", "--device", "cuda")
    with running_cluster(
        tiny_model_dir, tmp_path, transport=transport, worker_args=worker_args
    ) as launcher:
        c = _client(launcher)
        texts = [
            c.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == expected
        decode = next(s for s in worker_stats(launcher).values() if s["role"] == "decode")
        assert decode["num_recomputed"] == 0
        instances = launcher.get_json("/admin/instances")["data"]
        url = next(i["status_url"] for i in instances if i["role"] == "decode")
        pulled = metric_value(
            read_text(url + "/metrics"),
            "kvrelay_kv_transfer_bytes_total",
            transport="cuda_ipc" if transport == "auto" else "tcp",
        )
        assert pulled > 0


def test_gather_and_scatter_move_exact_blocks_in_order():
    """The helpers the GPU paths use are plain torch ops: on CPU pools they must move exactly
    the named blocks, in list order, and leave every other block alone."""
    from kvrelay.transport.blocks import (
        PinnedStaging,
        gather_device_blocks,
        scatter_device_blocks,
    )

    src = torch.randn(3, 2, 10, 4, 2, 8)
    dst = torch.randn(3, 2, 12, 4, 2, 8)
    before = dst.clone()
    src_ids, dst_ids = [7, 2, 3, 9], [0, 11, 5, 6]
    for staging in (None, PinnedStaging()):  # pinned where CUDA is, else pageable
        host = gather_device_blocks(src, src_ids, staging)
        assert host.shape == (3, 2, 4, 4 * 2 * 8 * 4) and host.dtype == torch.uint8
        scatter_device_blocks(dst, dst_ids, host.numpy().reshape(6, 4, -1))
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(dst[:, :, d], src[:, :, s])
        untouched = [b for b in range(12) if b not in dst_ids]
        assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    staging = PinnedStaging()
    assert staging.get(100).numel() == 100
    first = staging.get(10).data_ptr()
    assert staging.get(50).data_ptr() == first  # reused while it fits


def test_transports_a_pool_cannot_serve_are_refused():
    from kvrelay.worker.config import check_transport_for_device

    for transport in ("auto", "tcp", "shm"):
        check_transport_for_device(transport, torch.device("cpu"))
    for transport in ("auto", "tcp", "cuda_ipc"):
        check_transport_for_device(transport, torch.device("cuda", 0))  # only names the device
    with pytest.raises(ValueError, match="cuda_ipc needs a CUDA KV pool"):
        check_transport_for_device("cuda_ipc", torch.device("cpu"))
    with pytest.raises(ValueError, match="shm needs a CPU KV pool"):
        check_transport_for_device("shm", torch.device("cuda", 0))


def test_graph_batch_sizes_cover_max_num_seqs_and_a_cpu_pool_is_refused(tiny_model_dir):
    from kvrelay.engine.cuda_graphs import BATCH_SIZES, DecodeGraphs, batch_sizes

    assert batch_sizes(1) == (1,)
    assert batch_sizes(3) == (1, 2, 4)
    assert batch_sizes(256) == BATCH_SIZES and BATCH_SIZES[-1] == 256
    assert batch_sizes(300) == (*BATCH_SIZES, 300)
    assert list(BATCH_SIZES) == sorted(set(BATCH_SIZES))
    llm = LLM(tiny_model_dir, num_blocks=16, warm_up=False)
    assert llm.engine.runner.graphs is None  # a CPU engine has none
    with pytest.raises(ValueError, match="CUDA KV pool"):
        DecodeGraphs(llm.engine.runner.model, llm.engine.runner.kv_cache, 8, 4, None)


@needs_cuda
def test_lora_rows_on_cuda_follow_peft(tiny_model_dir, reference, tmp_path):
    """A batch of base and adapter rows on a GPU (adapter steps run eager, outside the CUDA
    graphs): each output is greedy under its own reference, the adapter's from peft."""
    from kvrelay import LoRARequest
    from tests.lora_adapters import make_adapter

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    adapter = make_adapter(tiny_model_dir, tmp_path / "sql", seed=5)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, adapter).eval()

    def tuned_logits(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return tuned(torch.tensor([token_ids])).logits[0].float()

    llm = LLM(tiny_model_dir, device="cuda", num_blocks=128, lora_modules=(("sql", str(adapter)),))
    loras = [LoRARequest("sql"), None] * (len(PROMPTS) // 2)
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras)
    for out, lora in zip(outputs, loras):
        ref = reference if lora is None else tuned_logits
        assert_greedy_under_reference(ref, out.prompt_token_ids, out.outputs[0].token_ids)
    llm.engine.block_manager.check_integrity()


@needs_cuda
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_speculative_rows_on_cuda_follow_the_reference(
    tiny_model_dir, reference, monkeypatch, graphs
):
    """n-gram drafts on a GPU (the draft's rows are decode rows: a decode graph when the
    step's rows fit one, eager otherwise): every kept token is the reference's argmax, and
    drafts were accepted."""
    monkeypatch.setenv("KVRELAY_CUDA_GRAPHS", graphs)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=128, speculative_config=spec)
    outputs = llm.generate(PROMPTS, GREEDY)
    for out in outputs:
        assert_greedy_under_reference(reference, out.prompt_token_ids, out.outputs[0].token_ids)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_leaked() == 0
    llm.engine.block_manager.check_integrity()


@needs_cuda
@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_embeddings_on_cuda_equal_the_cpu_engine(tiny_model_dir, kind):
    """Pooled prompts on a GPU (prompt steps replay graphs, chunks of one token are decode
    rows), beside generating sequences: the CPU engine's vectors within 1e-4."""
    from kvrelay import PoolingParams

    prompts = [[5, 6, 7] * n for n in (1, 9, 40)] + [[11]]
    args = dict(num_blocks=128, max_num_batched_tokens=64, pooler_config={"pooling_type": kind})
    want = LLM(tiny_model_dir, warm_up=False, **args).embed(prompts)
    llm = LLM(tiny_model_dir, device="cuda", **args)
    engine = llm.engine
    engine.add_request("gen", [3, 4, 5] * 7, GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"emb-{i}", prompt, SamplingParams(), pooling=PoolingParams())
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.embedding is not None:
                got[out.request_id] = out.embedding
    for i, expected in enumerate(want):
        assert torch.allclose(got[f"emb-{i}"], torch.tensor(expected.outputs.embedding), atol=1e-4)
    assert engine.block_manager.num_leaked() == 0


@needs_cuda
def test_a_cross_encoder_on_cuda_scores_as_the_cpu_engine(tiny_model_dir, tmp_path):
    """A one-label classifier's head on a GPU (``LlamaModel.classify`` on the device's
    pooled state): ``LLM.score`` and ``LLM.classify`` equal the CPU engine's within 1e-4."""
    from kvrelay.engine.make_tiny import make_classifier

    ckpt = make_classifier(tiny_model_dir, tmp_path / "ce", ("relevant",), seed=3)
    docs = ["a cat purrs", "stocks fell", "dogs bark " * 20]
    cpu = LLM(ckpt, warm_up=False, num_blocks=128)
    gpu = LLM(ckpt, device="cuda", num_blocks=128)
    for a, b in zip(cpu.score("which animal purrs?", docs), gpu.score("which animal purrs?", docs)):
        assert abs(a.outputs.score - b.outputs.score) < 1e-4
    (a,), (b,) = cpu.classify([[5, 6, 7] * 9]), gpu.classify([[5, 6, 7] * 9])
    assert abs(a.outputs.probs[0] - b.outputs.probs[0]) < 1e-4
