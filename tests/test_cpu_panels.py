"""``kernels.cpu_panels`` (``csrc/panels.c``): weights copied into panels of 16 columns, the
packed copy of steps of many rows on an AVX2 CPU. Products match torch's to float32 rounding in
both weight layouts, with a bias and with column counts that leave a partial last panel; a
row's result does not depend on the rest of the step (bit for bit), including steps long
enough to be cut into row blocks."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import cpu_panels

pytestmark = pytest.mark.skipif(
    not cpu_panels.available(), reason="kvrelay's native library is not built"
)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 48, 130, 300])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (96, 20), (576, 33)])
def test_products_match_torch_in_both_layouts(rows: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g)
    w_kn = torch.randn(k, n, generator=g)  # [in, out], kvrelay's projections
    bias = torch.randn(n, generator=g)
    panels = cpu_panels.pack(w_kn, transposed=True)
    assert panels.shape == (n, k) and panels.data.shape == (-(-n // 16), k, 16)
    got = cpu_panels.linear(x, panels, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, torch.addmm(bias, x, w_kn), rtol=1e-5, atol=1e-4)
    w_nk = w_kn.t().contiguous()  # [out, in]: a tied embedding as the LM head
    got_nk = cpu_panels.linear(x, cpu_panels.pack(w_nk, transposed=False))
    torch.testing.assert_close(got_nk, x @ w_kn, rtol=1e-5, atol=1e-4)
    assert torch.equal(got_nk + bias, cpu_panels.linear(x, panels) + bias)  # same panels


def test_padding_columns_are_zero() -> None:
    w = torch.ones(8, 20)
    data = cpu_panels.pack(w, transposed=True).data
    assert data.shape == (2, 8, 16)
    assert torch.all(data[1, :, 4:] == 0) and torch.all(data[1, :, :4] == 1)


@pytest.mark.parametrize("rows", [9, 64, 200])
def test_a_row_does_not_depend_on_the_rest_of_the_step(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=g)
    panels = cpu_panels.pack(torch.randn(160, 100, generator=g), transposed=True)
    batch = cpu_panels.linear(x, panels)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(cpu_panels.linear(x[i : i + 1], panels)[0], batch[i])


def test_bfloat16_weights_are_widened_exactly() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 40, generator=g).to(torch.bfloat16)
    x = torch.randn(10, 64, generator=g)
    from_bf16 = cpu_panels.pack(w, transposed=True)
    assert torch.equal(from_bf16.data, cpu_panels.pack(w.float(), transposed=True).data)
    got = cpu_panels.linear(x.to(torch.bfloat16), from_bf16)
    want = x.to(torch.bfloat16).float() @ w.float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused() -> None:
    panels = cpu_panels.pack(torch.randn(32, 16), transposed=True)
    with pytest.raises(ValueError, match="does not fit panels of k=32"):
        cpu_panels.linear(torch.randn(3, 31), panels)
    with pytest.raises(ValueError, match="panels take float32/bfloat16"):
        cpu_panels.pack(torch.randn(4, 4).half(), transposed=True)
    assert cpu_panels.linear(torch.randn(0, 32), panels).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 40, 200])
def test_the_plain_weight_gives_the_packed_sums_bit_for_bit(rows: int, dtype: torch.dtype) -> None:
    """Before the copies exist (or without them) a step multiplies the plain weight panel by
    panel: the same sums as on the copies, so its tokens do not depend on the packing."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w_kn = torch.randn(96, 40, generator=g).to(dtype)
    bias = torch.randn(40, generator=g)
    packed = cpu_panels.linear(x, cpu_panels.pack(w_kn, transposed=True), bias)
    assert torch.equal(cpu_panels.linear_plain(x, w_kn, True, bias), packed)
    w_nk = w_kn.t().contiguous()
    assert torch.equal(
        cpu_panels.linear_plain(x, w_nk, False),
        cpu_panels.linear(x, cpu_panels.pack(w_nk, transposed=False)),
    )


def test_widened_bfloat16_products_run_the_panels_where_they_are_the_packed_kernel(
    monkeypatch,
) -> None:
    """On a CPU without bfloat16 compute, gemv's fallback for many rows takes the packed
    kernel's sums: the panels' where they are chosen (bit for bit the packed copy's)."""
    from kvrelay.kernels import gemv

    monkeypatch.setattr(cpu_panels, "chosen", lambda: True)
    monkeypatch.setattr(gemv, "widens_bfloat16", lambda: True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(gemv.MAX_ROWS + 5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 48, generator=g).to(torch.bfloat16)  # [in, out]
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    want = cpu_panels.linear(x, cpu_panels.pack(w, transposed=True), bias).to(torch.bfloat16)
    assert torch.equal(gemv.matmul(x, w, bias), want)
    emb = w.t().contiguous()  # [vocab, hidden]: the tied LM head
    want_nt = cpu_panels.linear(x, cpu_panels.pack(emb, transposed=False)).to(torch.bfloat16)
    assert torch.equal(gemv.matmul_nt(x, emb), want_nt)


def _cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where there is none)."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return set(next((ln for ln in lines if ln.startswith("flags")), "").split())


def _uses_avx512() -> bool:
    """The library's own choice (csrc/gemv.c ``kv_use_avx512``), as the products make it."""
    from kvrelay.kernels import gemv

    return cpu_panels.available() and bool(gemv.load_library().kv_use_avx512())


@pytest.mark.skipif(not _uses_avx512(), reason="the AVX-512 tile needs a CPU with AVX-512")
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 64, 130, 300])
@pytest.mark.parametrize("n", [16, 33, 48, 100])
def test_the_avx512_tile_gives_the_avx2_tiles_sums_bit_for_bit(rows: int, n: int) -> None:
    """On AVX-512 a tile spans two panels (an odd last one alone, a partial one masked): the
    same sums over k in the same order as the AVX2 tile, so a token does not depend on which
    of the two CPUs computed it; with a bias, in both layouts and on the plain weights."""
    from kvrelay.kernels import gemv

    library = gemv.load_library()
    g = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, 576, generator=g)
    w_kn = torch.randn(576, n, generator=g)
    bias = torch.randn(n, generator=g)
    panels = cpu_panels.pack(w_kn, transposed=True)
    panels_nk = cpu_panels.pack(w_kn.t().contiguous(), transposed=False)
    old = library.panels_allow_avx512(-1)
    try:
        runs = []
        for allow in (1, 0):
            library.panels_allow_avx512(allow)
            runs.append(
                (
                    cpu_panels.linear(x, panels, bias),
                    cpu_panels.linear(x, panels_nk),
                    cpu_panels.linear_plain(x, w_kn, True, bias),
                )
            )
    finally:
        library.panels_allow_avx512(old)
    for wide, narrow in zip(runs[0], runs[1], strict=True):
        assert torch.equal(wide, narrow)
    torch.testing.assert_close(runs[0][0], torch.addmm(bias, x, w_kn), rtol=1e-5, atol=1e-3)


def test_panels_are_preferred_where_bfloat16_is_no_faster_than_float32() -> None:
    """The choice follows the CPU: AVX2 and FMA, no AMX, and AVX512-BF16's dot products (timed
    once against float32 multiply-adds; 0 where the CPU has none) under 1.25x their flops."""
    from kvrelay.kernels import gemv

    library = gemv.load_library()
    flags = _cpu_flags()
    ratio = library.panels_bf16_dot_ratio()
    assert ratio == library.panels_bf16_dot_ratio()  # measured once
    assert (ratio > 0) == ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags)
    want = {"avx2", "fma"} <= flags and "amx_bf16" not in flags and ratio < 1.25
    assert bool(library.panels_preferred()) == want == cpu_panels.preferred()
