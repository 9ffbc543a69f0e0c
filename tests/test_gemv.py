"""``kernels.gemv``: the native decode-step matmuls against torch, and the paths that fall back.

The library is built by ``pip install`` (setup.py); these tests need it, as CI builds it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="native gemv library not built")

# odd sizes hit every tail loop; 1001 leaves a chunk whose rows do not split evenly into the
# kernels' streams (a remainder after whole spans)
SHAPES = [(576, 960), (1536, 576), (1001, 1001), (37, 13), (8, 8), (100, 3)]


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> bool:
    """Equal up to summation order (float32) plus, for bfloat16, the output's one rounding
    (half a bfloat16 ulp: 2^-8 of the value)."""
    slack = 1e-4 * k**0.5
    if got.dtype == torch.bfloat16:
        slack = slack + want.abs() * 2**-8
    return bool(((got.float() - want).abs() <= slack).all())


@pytest.fixture(params=[1, 2, 3])
def threads(request: pytest.FixtureRequest):
    old = torch.get_num_threads()
    assert gemv.set_threads(request.param) == request.param
    yield request.param
    gemv.set_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, gemv.MAX_ROWS])
@pytest.mark.parametrize("k,n", SHAPES)
def test_matmul_equals_torch(threads: int, dtype: torch.dtype, rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(k, n, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    want = x.float() @ w.float()
    got = gemv.matmul(x, w)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert _close(got, want, k)
    # the bias is added to the rounded product, as torch's addmm does in bfloat16
    got_bias = gemv.matmul(x, w, bias)
    assert _close(got_bias, (got.float() + bias.float()).to(dtype).float(), k)
    # the tied LM head's layout: w stored [n, k]
    got_nt = gemv.matmul_nt(x, w.t().contiguous())
    assert got_nt.shape == (rows, n)
    assert _close(got_nt, want, k)


@pytest.mark.parametrize("rows", [1, 2, 5, gemv.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(576, 960), (1001, 64), (37, 96), (8, 32), (64, 40)])
def test_bfloat16_dot_product_path_equals_torch(rows: int, k: int, n: int) -> None:
    """A bfloat16 W stored ``[k, n]`` of a multiple of 32 columns, or stored ``[n, k]`` (the
    tied LM head) with k a multiple of 32, takes the AVX512-BF16 path where the CPU has it
    (VDPBF16PS), else AVX2's; both equal torch's product, and each other up to float32
    summation order (one bfloat16 ulp after the outputs' roundings)."""
    library = gemv.load_library()
    gen = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(k, n, generator=gen).to(torch.bfloat16)
    want = x.float() @ w.float()
    old = library.gemv_allow_avx512(-1)
    try:
        outs = []
        for allow in (1, 0):
            library.gemv_allow_avx512(allow)
            outs.append((gemv.matmul(x, w), gemv.matmul_nt(x, w.t().contiguous())))
            assert _close(outs[-1][0], want, k) and _close(outs[-1][1], want, k)
    finally:
        library.gemv_allow_avx512(old)
    # two roundings of float32 sums that differ in order: at most one bfloat16 ulp apart
    ulp = want.abs() * 2**-7 + 2e-4 * k**0.5
    for wide, narrow in zip(outs[0], outs[1]):
        assert bool(((wide.float() - narrow.float()).abs() <= ulp).all())


def test_bfloat16_dot_products_where_the_cpu_has_them() -> None:
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""  # noqa: SIM115
    has = all(f" {f} " in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
    assert bool(gemv.load_library().kv_use_avx512_bf16()) == has


def test_bfloat16_output_rounds_like_torch() -> None:
    """A bfloat16 result is the float32 sum rounded to nearest even, as torch rounds it."""
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    w = torch.zeros(8, 4, dtype=torch.bfloat16)
    w[0] = torch.tensor([1.0, 1.0, 256.0, -3.0])
    w[1] = torch.tensor([2**-8, 3 * 2**-8, 1.0, 2**-9]).to(torch.bfloat16)
    got = gemv.matmul(x, w)
    want = (x.float() @ w.float()).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_calls_the_library_for_decode_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    library = gemv.load_library()
    assert library is not None
    calls: list[tuple] = []
    real = library.gemv

    def spy(*args):
        calls.append(args[:5])
        return real(*args)

    monkeypatch.setattr(library, "gemv", spy)
    w = torch.randn(64, 32)
    for rows in (1, gemv.MAX_ROWS, gemv.MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64)
        assert torch.allclose(gemv.matmul(x, w), x @ w, atol=1e-4)
    assert [c[2] for c in calls] == [1, gemv.MAX_ROWS]  # larger batches stay with MKL
    calls.clear()
    # non-contiguous operands, other dtypes and mismatched shapes fall back to torch
    x = torch.randn(2, 64)
    strided = torch.randn(32, 64).t()  # [64, 32], not contiguous
    assert torch.allclose(gemv.matmul(x, strided), x @ strided, atol=1e-5)
    half = torch.randn(2, 64).half()
    assert gemv.matmul(half, torch.randn(64, 32).half()).dtype == torch.float16
    with pytest.raises(RuntimeError):
        gemv.matmul(torch.randn(2, 63), w)  # torch's own shape error
    assert calls == []


def test_matmul_nt_falls_back_for_large_batches() -> None:
    x, w = torch.randn(gemv.MAX_ROWS + 3, 40), torch.randn(17, 40)
    assert torch.allclose(gemv.matmul_nt(x, w), F.linear(x, w), atol=1e-5)


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_MATMUL", "0")
    gemv.load_library.cache_clear()
    try:
        assert not gemv.available()
        x, w = torch.randn(1, 16), torch.randn(16, 8)
        assert torch.equal(gemv.matmul(x, w), torch.mm(x, w))
    finally:
        monkeypatch.delenv("KVRELAY_NATIVE_MATMUL")
        gemv.load_library.cache_clear()
    assert gemv.available()


def test_a_library_built_from_older_sources_is_named_and_left_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``_gemv`` built before a function this kvrelay declares (an editable install not
    rebuilt) is not loaded: a warning names it and the missing function, and the products run
    in torch, instead of a worker failing at start on an undefined symbol."""
    if not gemv.available():
        pytest.skip("the native library is not built")
    import ctypes

    import kvrelay.transport

    # a real shared library that has none of _gemv's functions stands in for a stale build
    other = next(Path(kvrelay.transport.__file__).parent.glob("_kvcopy*.so"), None)
    if other is None:
        pytest.skip("the _kvcopy library is not built")
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda path: real_cdll(str(other)))
    gemv.load_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kvrelay.kernels.gemv"):
            assert gemv.load_library() is None
        assert "built from older sources" in caplog.text and "undefined symbol" in caplog.text
        x, w = torch.randn(1, 16), torch.randn(16, 8)
        assert torch.equal(gemv.matmul(x, w), torch.mm(x, w))
    finally:
        monkeypatch.undo()
        gemv.load_library.cache_clear()
    assert gemv.available()


def test_engine_decode_steps_use_the_library(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's projections and LM head go to the library with torch narrowed to one
    thread, a prefill step's projections stay with torch at the engine's threads, and the
    greedy tokens are the same as with the library off."""
    from kvrelay import LLM, SamplingParams

    library = gemv.load_library()
    assert library is not None
    seen: list[tuple[int, int]] = []  # (rows, torch threads) per library call
    real = library.gemv

    def spy(*args):
        seen.append((args[2], torch.get_num_threads()))
        return real(*args)

    old_threads = torch.get_num_threads()
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    # the per-op path (kernels.cpu_decode runs whole decode steps natively; its own tests)
    monkeypatch.setattr(llm.engine.runner.model, "_fused_for", lambda *a: None)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    monkeypatch.setattr(library, "gemv", spy)
    native = llm.generate(prompt, params)[0].outputs[0].token_ids
    layers = llm.engine.runner.model.config.num_layers
    # the prefill step (37 rows, torch at 2 threads) sends only its sampled row's LM head;
    # each of the 5 decode steps sends its 4 projections per layer and the LM head
    assert seen[0] == (1, 2)
    assert seen[1:] == [(1, 1)] * 5 * (4 * layers + 1)
    assert torch.get_num_threads() == 2  # restored after each decode step
    monkeypatch.setattr(gemv, "_native", lambda x, w: None)
    llm.engine.runner.narrow_decode = False
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == native
    torch.set_num_threads(old_threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_do_not_depend_on_which_thread_took_a_chunk(dtype: torch.dtype) -> None:
    """More pool threads than cores, so chunks go to whichever thread runs first: the partial
    sums must still be added in one order, or greedy decoding would change from run to run;
    and the library's own pool and OpenMP's give the same sums."""
    old = torch.get_num_threads()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 1536, generator=gen).to(dtype)
    w = torch.randn(1536, 960, generator=gen).to(dtype)
    try:
        gemv.set_threads(4)
        first = gemv.matmul(x, w)
        for openmp in (False, True):
            assert gemv.use_openmp(openmp) == openmp
            for _ in range(50):
                assert torch.equal(gemv.matmul(x, w), first)
    finally:
        gemv.use_openmp(False)
        gemv.set_threads(old)


def test_back_to_back_jobs_of_different_sizes_stay_apart() -> None:
    """The pool must not let a helper that read one job's ticket claim a chunk of the next job
    (whose fields the caller is writing): jobs of few and of many chunks alternate fast here,
    in a child process so that the crash this once caused fails the test, not the run."""
    import subprocess
    import sys

    script = """
import torch
from kvrelay.kernels import cpu_rows, gemv
gemv.set_threads(2)
torch.manual_seed(0)
x, w = torch.randn(1, 64), torch.randn(64, 8)
gate_up = torch.randn(64, 1024)
want_y = x @ w
want_act = torch.nn.functional.silu(gate_up[:, :512]) * gate_up[:, 512:]
for _ in range(20000):
    assert torch.allclose(gemv.matmul(x, w), want_y, atol=1e-4)
    assert torch.allclose(cpu_rows.silu_mul(gate_up), want_act, atol=1e-4)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_pool_is_torchs_openmp_runtime() -> None:
    """In OpenMP mode (the engine's batched steps) the library's jobs run on the same OpenMP
    runtime torch loaded, so native kernels and torch ops share one team of threads instead of
    two pools competing for the cores (csrc/gemv.c). Checked in a child: torch first, then
    the library, then one job."""
    import subprocess
    import sys

    script = """
import torch
from kvrelay.kernels import gemv
gemv.set_threads(2)
assert gemv.use_openmp(True)
x, w = torch.randn(2, 256), torch.randn(256, 512)
assert torch.allclose(gemv.matmul(x, w), x @ w, atol=1e-4)
maps = {line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line.rsplit("/", 1)[-1]}
print(len(maps), sorted(maps))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, _, names = done.stdout.strip().partition(" ")
    assert count == "1", f"OpenMP runtimes mapped: {names}"
