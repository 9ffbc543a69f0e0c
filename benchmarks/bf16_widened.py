"""bfloat16 products of many rows on a CPU where oneDNN does not compute bfloat16.

On such a CPU (an AVX2 one: ``gemv.widens_bfloat16``) torch's bfloat16 GEMMs take a slow
conversion path; kvrelay multiplies float32 copies instead and rounds the result to bfloat16
(``kernels/cpu_packed.py``). For each row count this times one layer's four projections of
a model (``--model``'s shapes, distinct weights for each of ``--layers`` layers, so that they
come from memory as in a step), in turns, medians of ``--repeats`` after three warm-ups:

- torch's bfloat16 ``mm`` on the plain weights (what a bfloat16 step did before);
- the widened fallback (``gemv.matmul``: oneDNN's float32 kernel on float32 copies of the
  operands, made each call), what runs until the packed copies exist;
- the packed float32 copies (``cpu_packed.linear``), what runs once they do;
- float32 ``mm`` on float32 weights, for reference.

Prints a Markdown table; the results of the widened paths agree with torch's bfloat16 ones
to a bfloat16 rounding (checked here on the first layer).

    python benchmarks/bf16_widened.py --model DIR [--rows 16 64 256] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from decode_attention import median_ms  # benchmarks/, the script's directory

from kvrelay.kernels import cpu_packed, gemv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def shapes(model: Path) -> tuple[int, list[tuple[int, int]]]:
    """The model's layer count and its projections' ``[in, out]`` shapes."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads) * head_dim
    qkv = heads * head_dim + 2 * kv
    return cfg["num_hidden_layers"], [
        (hidden, qkv), (heads * head_dim, hidden), (hidden, 2 * inter), (inter, hidden)
    ]  # fmt: skip


def _paths(
    xs: dict[int, torch.Tensor], plain: list[list[torch.Tensor]], packed: list[list[torch.Tensor]]
) -> dict[str, Callable[[], object]]:
    """Each way of computing every layer's products for the rows ``xs`` (by input size)."""
    pairs = [(w, p) for layer, pl in zip(plain, packed, strict=True)
             for w, p in zip(layer, pl, strict=True)]  # fmt: skip
    wide = [(w.float(), xs[w.shape[0]].float()) for w, _ in pairs]
    return {
        "bf16": lambda: [torch.mm(xs[w.shape[0]], w) for w, _ in pairs],
        "fallback": lambda: [gemv.matmul(xs[w.shape[0]], w) for w, _ in pairs],
        "packed": lambda: [cpu_packed.linear(xs[w.shape[0]], p) for w, p in pairs],
        "f32": lambda: [torch.mm(x, w) for w, x in wide],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gemv.set_threads(args.threads)
    num_layers, dims = shapes(Path(args.model))
    num_layers = args.layers or num_layers
    g = torch.Generator().manual_seed(0)
    plain = [
        [torch.randn(k, n, generator=g).bfloat16() for k, n in dims] for _ in range(num_layers)
    ]
    packed = [[cpu_packed.pack(w, transposed=True) for w in layer] for layer in plain]
    print(f"widens bfloat16 here: {gemv.widens_bfloat16()}; packed copies: {packed[0][0].dtype}; "
          f"{num_layers} layers of {dims}, {args.threads} threads")  # fmt: skip
    print("| rows | torch bfloat16 mm ms | widened fallback | packed copies | float32 mm |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for k, _ in dims}}
        first = plain[0][0]
        want = torch.mm(xs[first.shape[0]], first)
        got = gemv.matmul(xs[first.shape[0]], first)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2)
        paths = _paths(xs, plain, packed)
        ms = {name: median_ms(fn, args.repeats) for name, fn in paths.items()}
        print(f"| {rows} | {ms['bf16']:.1f} | {ms['fallback']:.1f} | {ms['packed']:.1f} | "
              f"{ms['f32']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
