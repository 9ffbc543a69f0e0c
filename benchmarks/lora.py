"""LoRA adapters: what serving through them costs against the base model alone (offline engine).

One ``LLM`` holds ``--adapters`` random adapters of rank ``--rank`` on every projection
(q/k/v/o, gate/up/down), written in PEFT's file format. The same 64 mixed requests (prompts
16-128 tokens, outputs 16-64, greedy, eos ignored; ``peers.py``'s offline workload) run:

- ``base``: every request on the base model;
- ``one adapter``: every request through the first adapter;
- ``mixed``: requests spread round-robin over the base and every adapter, so each step
  carries several adapters' rows;

interleaved (base, one, mixed, then the reverse order), medians of ``--repeats``; plus a lone
request's decode step (prompt 16, 128 tokens out, time per token after the first) on the base
and through an adapter.

    python benchmarks/lora.py --model /work/cache/models/smollm2-hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    update_benchmarks_md,
)
from safetensors.torch import save_file

from kvrelay import LLM, LoRARequest, SamplingParams

SECTION = "LoRA adapters: cost against the base model (offline engine)"
TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/work/cache/models/smollm2-hf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A random adapter in PEFT's format (``tests/test_lora.py`` checks the engine against
    ``peft`` itself; here only the shapes matter)."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for block, modules in TARGETS.items():
            for module in modules:
                fan_in, fan_out = shapes[module]
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [m for ms in TARGETS.values() for m in ms]}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))], rng.randint(16, 64))
        for _ in range(n)
    ]


def run_mode(llm: LLM, reqs: list[tuple[list[int], int]], loras: list[LoRARequest | None]) -> float:
    """Output tokens per second of one run of ``reqs`` (request i through ``loras[i]``)."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    started = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def decode_step_ms(llm: LLM, lora: LoRARequest | None, vocab: int) -> float:
    prompt = [random.Random(1).randrange(3, vocab) for _ in range(16)]
    times = []
    for _ in range(3):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([prompt], params, lora_request=lora)
        first = time.perf_counter() - started
        params = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([prompt], params, lora_request=lora)
        times.append((time.perf_counter() - started - first) / 128 * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            write_adapter(model, Path(tmp) / f"a{i}", args.rank, seed=i)
            for i in range(args.adapters)
        ]
        modules = tuple((f"a{i}", str(p)) for i, p in enumerate(adapters))
        llm = LLM(
            model, dtype=args.dtype, num_threads=args.threads, lora_modules=modules,
            enable_prefix_caching=False,  # every run computes every prompt
        )  # fmt: skip
        reqs = requests(args.num_requests, vocab)
        first = LoRARequest("a0")
        spread: list[LoRARequest | None] = [None, *(LoRARequest(n) for n, _ in modules)]
        modes: dict[str, list[LoRARequest | None]] = {
            "base": [None] * len(reqs),
            "one adapter": [first] * len(reqs),
            f"mixed: base + {args.adapters} adapters": [
                spread[i % len(spread)] for i in range(len(reqs))
            ],
        }
        warm = reqs[:8]
        run_mode(llm, warm, [None] * len(warm))  # warm-up
        run_mode(llm, warm, [first] * len(warm))
        runs: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.repeats):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                runs[mode].append(run_mode(llm, reqs, modes[mode]))
                print(mode, round(runs[mode][-1], 1), flush=True)
        steps = {
            "base": decode_step_ms(llm, None, vocab),
            "one adapter": decode_step_ms(llm, first, vocab),
        }
    base = statistics.median(runs["base"])
    rows = []
    for mode, values in runs.items():
        med = statistics.median(values)
        step = steps.get(mode)
        rows.append([
            mode, f"{med:.1f}", " / ".join(f"{v:.1f}" for v in values), f"{med / base:.2f}x",
            "" if step is None else f"{step:.1f}",
            "" if step is None else f"{step / steps['base']:.2f}x",
        ])  # fmt: skip
    table = markdown_table(
        ["requests", "offline tok/s (median)", "runs", "vs base", "lone decode step ms",
         "step vs base"], rows,
    )  # fmt: skip
    body = (
        f"Model `{model.name}`, {args.dtype}, {args.threads} threads; {args.adapters} random "
        f"adapters of rank {args.rank} on q/k/v/o and gate/up/down; {args.num_requests} "
        "requests (prompts 16-128 tokens, outputs 16-64, greedy, eos ignored), modes "
        f"interleaved, {args.repeats} runs each.\n\n{table}\n\n"
        f"{machine_markdown(machine_info(args.threads))}"
    )
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION, body, command_line(__file__))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
