"""Decode on a GPU: the Triton paged-attention kernel and CUDA graphs against the torch path.

Runs only where torch sees a CUDA device (the lent GPU machine); ``--render`` rebuilds the
BENCHMARKS.md section from a saved ``--json`` anywhere.

Attention alone (one layer, bfloat16, block size 16, block tables shuffled over the pool):
the torch path (``attention.paged_attention`` with decode groups: gather the context blocks,
masked SDPA) against the Triton kernel (``triton_attention``), both with the store of the
step's new K/V, for SmolLM2-135M's heads (9 query, 3 kv, 64 dims) and Llama-3-8B's (32, 8,
128). GB/s counts the K and V bytes the step must read once.

The engine's decode step (``LLMEngine.step``, sampling and the host copy of the tokens
included) on a checkpoint with SmolLM2-135M's config and tokenizer and random weights (its
real weights do not travel to the GPU machine; the step's work depends only on the shapes):
torch attention eager, Triton eager (``KVRELAY_CUDA_GRAPHS=0``), Triton with CUDA graphs,
for batches of 1-128 sequences of 512 prompt tokens, median of the timed steps.

    python benchmarks/gpu_decode.py --like /path/to/smollm2-config-dir --json /tmp/gd.json
    python benchmarks/gpu_decode.py --render /tmp/gd.json       # writes BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import command_line, markdown_table, median, update_benchmarks_md, write_json

from kvrelay.engine.engine import LLMEngine
from kvrelay.kernels import triton_attention
from kvrelay.kernels.attention import AttentionMetadata, decode_groups, paged_attention
from kvrelay.kernels.cpu_attention import make_decode
from kvrelay.protocol.sampling_params import SamplingParams

SECTION_TITLE = "GPU decode (Triton paged attention, CUDA graphs)"
BLOCK_SIZE = 16
HEADS = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}
ATTN_BATCHES = (1, 16, 64, 256)
ATTN_CONTEXTS = (512, 2048)
STEP_BATCHES = (1, 8, 32, 128)
SYSTEMS = {  # name -> environment of the engine
    "torch attention, eager": {"KVRELAY_NATIVE_ATTENTION": "0", "KVRELAY_CUDA_GRAPHS": "0"},
    "Triton, eager": {"KVRELAY_NATIVE_ATTENTION": "1", "KVRELAY_CUDA_GRAPHS": "0"},
    "Triton + CUDA graphs": {"KVRELAY_NATIVE_ATTENTION": "1", "KVRELAY_CUDA_GRAPHS": "1"},
}


def event_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after three warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + written) of 1 GiB."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = event_time(lambda: b.copy_(a), 10)
    return 2 * a.numel() / ms / 1e6


def measure_attention(name: str, batch: int, ctx: int, repeats: int) -> dict[str, Any]:
    q_heads, kv_heads, head_dim = HEADS[name]
    dtype, dev = torch.bfloat16, torch.device("cuda")
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * per_seq + 8
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=dev)
    order = torch.randperm(num_blocks).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    rows, ctx_lens = list(range(batch)), [ctx] * batch
    q = torch.randn(batch, q_heads, head_dim, dtype=dtype, device=dev)
    k = torch.randn(batch, kv_heads, head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    slots = torch.tensor([t[-1] * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE for t in tables], device=dev)
    torch_meta = AttentionMetadata(slot_mapping=slots)
    torch_meta.decode = decode_groups(rows, ctx_lens, tables, BLOCK_SIZE, None)
    torch_meta = torch_meta.to(dev)
    triton_meta = AttentionMetadata(slot_mapping=slots)
    triton_meta.native_decode = make_decode(rows, ctx_lens, tables)
    triton_meta = triton_meta.to(dev)
    scale = head_dim**-0.5
    out_t = paged_attention(q, k, v, kv, torch_meta, scale)
    out_n = paged_attention(q, k, v, kv, triton_meta, scale)
    err = float((out_t.float() - out_n.float()).abs().max())
    torch_ms = event_time(lambda: paged_attention(q, k, v, kv, torch_meta, scale), repeats)
    triton_ms = event_time(lambda: paged_attention(q, k, v, kv, triton_meta, scale), repeats)
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * kv.element_size()
    return {
        "heads": name,
        "batch": batch,
        "ctx": ctx,
        "torch_us": 1000 * torch_ms,
        "triton_us": 1000 * triton_ms,
        "triton_gbps": kv_bytes / triton_ms / 1e6,
        "splits": triton_attention.num_splits(batch, kv_heads, dev),
        "max_abs_diff": err,
    }


def random_checkpoint(like: Path, out: Path, dtype: torch.dtype) -> Path:
    """``like``'s config and tokenizer with random weights (0.02-scaled normals)."""
    from safetensors.torch import save_file

    cfg = json.loads((like / "config.json").read_text())
    for f in like.iterdir():
        if f.suffix in (".json", ".txt", ".jinja", ".model") and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qh, kvh, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    w = {"model.embed_tokens.weight": rnd(vocab, h)}
    w["model.norm.weight"] = torch.ones(h, dtype=dtype)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "self_attn.q_proj.weight"] = rnd(qh * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kvh * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kvh * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, qh * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rnd(vocab, h)
    save_file(w, str(out / "model.safetensors"))
    return out


def measure_steps(
    model: Path, system: str, batch: int, prompt_len: int, steps: int
) -> dict[str, Any]:
    """Median ms of a decode step of ``batch`` sequences (after their prefill)."""
    os.environ.update(SYSTEMS[system])
    per_seq = -(-(prompt_len + steps + 8) // BLOCK_SIZE)
    engine = LLMEngine.from_args(
        model,
        dtype="bfloat16",
        device="cuda",
        skip_tokenizer_init=True,
        num_blocks=batch * per_seq + 16,
        max_num_seqs=max(batch, 8),
        max_num_batched_tokens=max(8192, prompt_len),
        enable_prefix_caching=False,
    )
    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        tokens = [(i * 7919 + t * 131) % vocab for t in range(prompt_len)]
        engine.add_request(f"r{i}", tokens, params)
    while engine.scheduler.waiting or engine.last_step_kind != "decode":
        engine.step()
    for _ in range(3):  # graph capture of this batch size, kernels' compilation
        engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    graphs = engine.runner.graphs
    result = {
        "system": system,
        "batch": batch,
        "prompt_len": prompt_len,
        "step_ms": median(times),
        "graph_replays": graphs.replays if graphs else 0,
    }
    del engine
    torch.cuda.empty_cache()
    return result


def render(data: dict[str, Any]) -> str:
    lines = [
        f"Measured on {data['device']} (torch {data['torch']}, Triton {data['triton']}); "
        f"device-to-device copy {data['copy_gbps']:.0f} GB/s (read + written). Medians of "
        f"{data['repeats']} CUDA-event-timed calls after warm-ups (attention), of "
        f"{data['steps']} synchronised `LLMEngine.step()` calls (decode steps).",
        "",
        "**Decode attention, one layer, bfloat16** (the step's K/V store included; GB/s: the "
        "context's K and V bytes over the Triton kernel's time):",
        "",
    ]
    rows = [
        [
            r["heads"], r["batch"], r["ctx"], f"{r['torch_us']:.1f}", f"{r['triton_us']:.1f}",
            f"{r['torch_us'] / r['triton_us']:.2f}x", f"{r['triton_gbps']:.0f}", r["splits"],
            f"{r['max_abs_diff']:.1e}",
        ]
        for r in data["attention"]
    ]  # fmt: skip
    headers = ["heads", "seqs", "context", "torch path us", "Triton us", "speed-up",
               "Triton GB/s", "splits", "max abs diff"]  # fmt: skip
    lines += [markdown_table(headers, rows), ""]
    lines += [
        "Each call is eager, launched from Python: at a few sequences its time is the launches' "
        "(the store, the attention and, with splits, the combining kernel), which a CUDA graph "
        "removes (below). At many sequences the kernel reads the context at close to the "
        "device's copy rate; the torch path gathers it into a padded copy first.",
        "",
    ]
    lines += [
        f"**Decode step, {data['model']}, bfloat16, {data['prompt_len']}-token prompts** "
        "(ms per `LLMEngine.step()`, sampling and the tokens' copy to the host included):",
        "",
    ]
    by = {(r["system"], r["batch"]): r for r in data["steps_rows"]}
    batches = sorted({r["batch"] for r in data["steps_rows"]})
    names = list(SYSTEMS)
    rows = []
    for b in batches:
        base = by[(names[0], b)]["step_ms"]
        row: list[Any] = [b]
        for name in names:
            ms = by[(name, b)]["step_ms"]
            row += [f"{ms:.2f}", f"{base / ms:.2f}x"]
        row.append(f"{1000 * b / by[(names[-1], b)]['step_ms']:.0f}")
        rows.append(row)
    headers = ["seqs"]
    for name in names:
        headers += [f"{name} ms", "vs torch"]
    headers.append("graphs tok/s")
    lines += [markdown_table(headers, rows), ""]
    lines += [f"- {note}" for note in data.get("notes", [])] + ([""] if data.get("notes") else [])
    lines.append(
        "vLLM is not beside these figures: the GPU machine reaches no package index, and "
        "vLLM's CUDA wheel (with its own torch build) is larger than what can be carried to it."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", type=Path, help="a checkpoint dir whose config and tokenizer to use")
    p.add_argument("--model", type=Path, help="a checkpoint to run as it is (instead of --like)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--render", type=Path, help="only rebuild BENCHMARKS.md from this JSON")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_decode.py needs a CUDA device (use --render JSON elsewhere)")
        if (args.like is None) == (args.model is None):
            sys.exit("give one of --like DIR or --model DIR")
        import triton

        data = {
            "command": command_line(),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_gbps": copy_bandwidth(),
            "repeats": args.repeats,
            "steps": args.steps,
            "prompt_len": args.prompt_len,
            "attention": [],
            "steps_rows": [],
        }
        for name in HEADS:
            for ctx in ATTN_CONTEXTS:
                for b in ATTN_BATCHES:
                    row = measure_attention(name, b, ctx, args.repeats)
                    print(json.dumps(row), flush=True)
                    data["attention"].append(row)
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or random_checkpoint(args.like, Path(tmp), torch.bfloat16)
            data["model"] = (
                f"{args.like.name} shapes, random weights" if args.like else args.model.name
            )
            for b in STEP_BATCHES:
                for system in SYSTEMS:
                    row = measure_steps(model, system, b, args.prompt_len, args.steps)
                    print(json.dumps(row), flush=True)
                    data["steps_rows"].append(row)
        if args.json:
            write_json(args.json, data)
    body = render(data)
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION_TITLE, body, data["command"])


if __name__ == "__main__":
    main()
