"""Benchmark scripts: the engine throughput run end to end on the tiny model (a smoke test,
not a timing), and the shared BENCHMARKS.md section writer."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "engine_throughput.py"


def _load_common():
    spec = importlib.util.spec_from_file_location("bench_common", SCRIPT.parent / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_engine_throughput_quick(tiny_model_dir, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out_json = tmp_path / "result.json"
    benchmarks_md = REPO_ROOT / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    cmd = [
        sys.executable, str(SCRIPT), "--quick", "--skip-hf-cb", "--no-write",
        "--num-requests", "4", "--model-dir", str(tiny_model_dir), "--output-len", "4", "16",
        "--attempts", "1", "--max-wait-quiet", "0", "--json", str(out_json),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"kvrelay LLM.generate: [\d,]+\.\d tok/s", proc.stdout), proc.stdout
    assert "static batch 8" in proc.stdout
    data = json.loads(out_json.read_text())
    kvrelay = data["results"][0]
    assert kvrelay["useful_tokens"] == kvrelay["computed_tokens"] > 0
    assert kvrelay["tokens_per_s"] > 0
    static = [r for r in data["results"] if "static" in r["name"]]
    assert [r["useful_tokens"] for r in static] == [kvrelay["useful_tokens"]] * 3
    assert all(r["computed_tokens"] >= r["useful_tokens"] for r in static)
    assert data["decode"]["step_s"] > 0 and data["decode"]["bandwidth"] > 0
    after = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    assert after == before, "--no-write must leave BENCHMARKS.md alone"


def test_update_benchmarks_md_replaces_only_its_section(tmp_path: Path) -> None:
    common = _load_common()
    path = tmp_path / "BENCHMARKS.md"
    common.update_benchmarks_md("A", "first a", "run a", path=path)
    common.update_benchmarks_md("B", "b body\n\n```\n## not a heading\n```", "run b", path=path)
    common.update_benchmarks_md("A", "second a", "run a2", path=path)
    text = path.read_text()
    preamble, sections = common.split_sections(text)
    assert preamble.startswith("# Benchmarks")
    assert [title for title, _ in sections] == ["A", "B"]
    assert "second a" in sections[0][1] and "run a2" in sections[0][1]
    assert "first a" not in text and "run a\n" not in text
    assert "## not a heading" in sections[1][1] and "run b" in sections[1][1]
    common.update_benchmarks_md("B", "b body\n\n```\n## not a heading\n```", "run b", path=path)
    assert path.read_text() == text


def test_update_benchmarks_md_keeps_a_sections_history_below_the_new_run(tmp_path: Path) -> None:
    """The peer comparisons' sections: a new run on top, the earlier runs kept below."""
    common = _load_common()
    path = tmp_path / "BENCHMARKS.md"
    common.update_benchmarks_md("Peers", "run one", "cmd 1", path=path, history=True)
    common.update_benchmarks_md("Other", "other body", "cmd o", path=path)
    common.update_benchmarks_md("Peers", "run two", "cmd 2", path=path, history=True)
    _, sections = common.split_sections(path.read_text())
    assert [title for title, _ in sections] == ["Peers", "Other"]
    peers = sections[0][1]
    assert peers.count("## Peers") == 1
    assert peers.index("run two") < peers.index("cmd 2") < peers.index("run one")
    assert peers.index("run one") < peers.index("cmd 1")
    common.update_benchmarks_md("Peers", "run three", "cmd 3", path=path)  # no history: replaced
    assert "run one" not in path.read_text() and "run two" not in path.read_text()


def test_sections_name_their_model_and_dtype(tmp_path: Path) -> None:
    common = _load_common()
    imported = tmp_path / "smollm2"
    imported.mkdir()
    record = {"source": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "bfloat16"}
    (imported / "kvrelay_import.json").write_text(json.dumps(record))
    assert common.model_label(imported) == "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    assert common.model_label(tmp_path / "ckpt") == "`ckpt`"
    assert common.model_label(None, "medium") == "make_tiny `medium` llama"
    title = common.section_title("Engine throughput (offline, CPU)", imported, "small", "bfloat16")
    assert title == "Engine throughput (offline, CPU): SmolLM2-135M-Instruct, bfloat16"
    parser = argparse.ArgumentParser()
    common.add_model_args(parser)
    args = parser.parse_args(["--model-dir", str(imported), "--dtype", "bfloat16"])
    assert args.model_dir == imported and args.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])


@pytest.fixture(scope="module")
def native_build_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--build-cache`` for engine_ab.py and serving_cpu.py: the base (HEAD) is compiled by
    the first of them to run, the other copies its libraries (the same sources)."""
    return tmp_path_factory.mktemp("native-build-cache")


@pytest.mark.timeout(600)
def test_engine_ab_runs_a_commit_against_the_tree(
    tiny_model_dir, native_build_cache: Path, tmp_path: Path
) -> None:
    """benchmarks/engine_ab.py end to end on the tiny model, HEAD against the working tree:
    the base is checked out and built in a worktree (built once for this test and
    serving_cpu's: ``native_build_cache``), both engines answer,
    and the worktree is removed afterwards (a smoke test, not a timing)."""
    inside = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True)
    if inside.returncode != 0:
        pytest.skip("the checkout is not a git repository: engine_ab needs one for its worktree")
    worktree = tmp_path / "base"
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "engine_ab.py"), "--model",
        str(tiny_model_dir), "--base", "HEAD", "--worktree", str(worktree), "--dtype", "float32",
        "--repeats", "1", "--num-requests", "4", "--max-wait-quiet", "0", "--build-cache",
        str(native_build_cache),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"base: offline [\d.]+ tok/s", proc.stdout), proc.stdout
    assert re.search(r"head: offline [\d.]+ tok/s .*decode step [\d.]+ ms", proc.stdout)
    assert re.search(r"base: prefill step of 8 x 256 tokens \d+ ms", proc.stdout), proc.stdout
    paired = r"head / base offline, paired by repeat: [\d.]+x \([\d.]+-[\d.]+\)"
    assert re.search(paired, proc.stdout), proc.stdout
    assert not worktree.exists()
    listed = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "list"], capture_output=True, text=True
    )
    assert str(worktree) not in listed.stdout


@pytest.mark.timeout(300)
def test_decode_attention_benchmark_times_the_tree_kernel(tmp_path: Path) -> None:
    """benchmarks/decode_attention.py without --base: one case timed in a child process over
    scattered blocks, a table row with the time and bandwidth (a smoke test, not a timing)."""
    gemv = pytest.importorskip("kvrelay.kernels.gemv")
    if gemv.load_library() is None:
        pytest.skip("the native library is not built")
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "decode_attention.py"), "--cases",
        "f32:2:40", "bf16:3:17", "lm:f32:3", "--rounds", "1", "--iters", "2", "--pool-blocks",
        "64",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| ([\w:]+) \| ([\d.]+) \(([\d.]+)\) \|$", proc.stdout, re.M)
    assert [case for case, _, _ in rows] == ["f32:2:40", "bf16:3:17", "lm:f32:3"], proc.stdout
    assert all(float(ms) > 0 and float(gb_s) > 0 for _, ms, gb_s in rows)
    assert re.search(r"f32:2:40 tree: checksum -?[\d.]+", proc.stderr), proc.stderr


def _load_benchmark(name: str):
    """``benchmarks/NAME.py`` as a module (its sibling imports resolved)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            f"bench_{name}", REPO_ROOT / "benchmarks" / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))


def test_gpu_decode_random_checkpoint_loads_and_generates(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/gpu_decode.py's stand-in checkpoint (a real config and tokenizer, random
    weights) loads in the engine with the original's shapes (here on CPU)."""
    import torch

    from kvrelay import LLM, SamplingParams

    gpu_decode = _load_benchmark("gpu_decode")
    out = gpu_decode.random_checkpoint(tiny_model_dir, tmp_path, torch.float32)
    llm = LLM(out, num_blocks=32, warm_up=False)
    original = LLM(tiny_model_dir, num_blocks=32, warm_up=False)
    assert llm.engine.config.model_config == original.engine.config.model_config
    shapes = {n: w.shape for n, w in llm.engine.runner.model.weights.items()}
    assert shapes == {n: w.shape for n, w in original.engine.runner.model.weights.items()}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["a prompt"], params)[0].outputs[0].token_ids) == 4


def test_gpu_decode_renders_its_tables() -> None:
    gpu_decode = _load_benchmark("gpu_decode")
    attention = [
        {"heads": "SmolLM2-135M", "batch": 1, "ctx": 512, "torch_us": 50.0, "triton_us": 20.0,
         "triton_gbps": 10.0, "splits": 16, "max_abs_diff": 1e-3},
    ]  # fmt: skip
    steps = [
        {"system": name, "batch": b, "prompt_len": 512, "step_ms": ms, "graph_replays": 0}
        for b in (1, 8)
        for name, ms in zip(gpu_decode.SYSTEMS, (12.0, 10.0, 4.0), strict=True)
    ]
    data = {
        "command": "python benchmarks/gpu_decode.py", "device": "GPU", "torch": "2", "triton": "3",
        "copy_gbps": 3000.0, "repeats": 5, "steps": 5, "prompt_len": 512, "model": "m",
        "attention": attention, "steps_rows": steps,
    }  # fmt: skip
    body = gpu_decode.render(data)
    assert "| SmolLM2-135M | 1 | 512 | 50.0 | 20.0 | 2.50x | 10 | 16 | 1.0e-03 |" in body
    assert "| 8 | 12.00 | 1.00x | 10.00 | 1.20x | 4.00 | 3.00x | 2000 |" in body


@pytest.mark.timeout(240)
def test_start_time_benchmark_starts_a_cluster_and_answers(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/start_time.py on this tree, one timed start (a smoke test, not a timing):
    kvrelay up comes up, answers a 1-token completion, serves --bench-requests on the fresh
    cluster, and is stopped."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "start_time.py"), "--model",
        str(tiny_model_dir), "--trees", str(REPO_ROOT), "--labels", "tree", "--repeats", "1",
        "--bench-requests", "3", "--bench-rate", "inf", "--warm-up-starts", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    number = r"([\d.]+)"
    cells = [number] * 3 + [r"1\.00x"] + [number] * 3
    pattern = r"^\| tree \| " + r" \| ".join(cells) + r" \|$"
    row = re.search(pattern, proc.stdout, re.M)
    assert row is not None and float(row.group(1)) > 0, proc.stdout
    # first TTFT, then TPOT p50: 0.0 ms is a valid reading (on a loaded machine a stream's
    # tokens can reach the client in one read, seen in CI), so only that it was measured
    assert float(row.group(4)) > 0 and float(row.group(6)) >= 0


def _gpu_steps(model_dir: Path, *args: str) -> list[str]:
    """benchmarks/gpu_steps.py on CPU with ``model_dir``'s shapes and 24-token prompts."""
    script = str(REPO_ROOT / "benchmarks" / "gpu_steps.py")
    return [sys.executable, script, "--like", str(model_dir), "--device", "cpu",
            "--prompt-len", "24", *args]  # fmt: skip


@pytest.mark.timeout(240)
def test_gpu_steps_times_each_step_on_cpu(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/gpu_steps.py on CPU with the tiny model's shapes (a smoke test, not a
    timing): staggered requests make decode and mixed steps, two passes, no Triton kernel."""
    cmd = _gpu_steps(tiny_model_dir, "--requests", "6", "--concurrency", "3", "--passes", "2",
                     "--profile")  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for kind in ("pass1 decode", "pass2 decode", "pass1 mixed", "pass2 mixed"):
        # each line names its prefill path (--prefill, triton by default; on CPU it is unused)
        assert re.search(rf"^triton {kind}: n=\d+ median [\d.]+ ms", proc.stdout, re.M), proc.stdout
    assert "[triton] kernels at the end 0" in proc.stdout
    assert "Self CPU time total" in proc.stdout  # --profile: the profiler's table


@pytest.mark.timeout(240)
def test_gpu_steps_compares_the_mixed_step_paths_on_cpu(tiny_model_dir, tmp_path: Path) -> None:
    """``--mixed-graphs all``: whole-step graphs, pieces and eager, each on its own engine,
    the same workload, and a line per step kind comparing each with the first (on CPU the
    graphs run uncaptured: a smoke test of the comparison, not a timing)."""
    cmd = _gpu_steps(tiny_model_dir, "--requests", "4", "--concurrency", "2", "--passes", "1",
                     "--output-len", "8", "24", "--mixed-graphs", "all")  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for path in ("graphs", "pieces", "eager"):
        assert re.search(rf"^{path} pass1 mixed: n=\d+ median [\d.]+ ms", proc.stdout, re.M)
    for other in ("pieces", "eager"):
        line = rf"^last pass mixed median: graphs [\d.]+ ms, {other} [\d.]+ ms \({other} / graphs"
        assert re.search(line, proc.stdout, re.M), proc.stdout
    both = [*cmd[:-1], "both", "--prefill", "both"]
    proc = subprocess.run(both, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "compare one thing at a time" in proc.stderr


def test_token_path_tables_its_json() -> None:
    """benchmarks/token_path.py renders a kept run (the H100's) as its table."""
    module = _load_benchmark("token_path")
    run = json.loads((REPO_ROOT / "benchmarks" / "token_path_h100.json").read_text())
    assert run["section"] == module.SECTION_GPU
    table = module.table_of(run["results"]).splitlines()
    assert len(table) == 2 + 6  # header, rule, two systems x three stream counts
    assert table[2].startswith("| kvrelay colocated | 1 | 2.8 / 2.6 |")
    assert table[-1].startswith("| kvrelay 1P+1D | 32 | 5.7 / 0.2 |")


@pytest.mark.timeout(600)
def test_serving_cpu_measures_a_commit_against_the_tree(
    tiny_model_dir, native_build_cache: Path, tmp_path: Path
) -> None:
    """benchmarks/serving_cpu.py, HEAD against the working tree, one round (a smoke test,
    not a timing): both clusters serve the bench, the CPU per token is read, the worktree
    goes."""
    inside = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True)
    if inside.returncode != 0:
        pytest.skip("the checkout is not a git repository: serving_cpu needs one for its worktree")
    worktree = tmp_path / "base"
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "serving_cpu.py"), "--base", "HEAD",
        "--model", str(tiny_model_dir), "--rounds", "1", "--requests", "6", "--concurrency",
        "3", "--prompt-len", "8", "--output-len", "8", "--num-warmup", "1", "--worktree",
        str(worktree), "--build-cache", str(native_build_cache), "--port", "18960",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for label in (r"base \(HEAD\)", "tree"):
        # CPU columns can round to 0 over so short a run (10 ms clock ticks); tok/s cannot
        row = rf"^\| {label} \| \d+ \| \d+ \| (\d+) \| [\d.]+ \|$"
        match = re.search(row, proc.stdout, re.M)
        assert match, proc.stdout
        assert int(match.group(1)) > 0
    assert not worktree.exists()


@pytest.mark.timeout(120)
def test_prefill_attention_times_the_kernel_beside_sdpa(tmp_path: Path) -> None:
    """benchmarks/prefill_attention.py, one length per dtype (a smoke test, not a timing):
    SDPA and every path of the kernel the CPU has, each with its ratio."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "prefill_attention.py"),
        "--lengths", "64", "--iters", "1", "--paths", "2", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for dtype in ("float32", "bfloat16"):
        line = re.search(rf"^{dtype}\s+64 x\s+32: SDPA\s+([\d.]+) ms(.*)$", proc.stdout, re.M)
        assert line is not None and float(line.group(1)) > 0, proc.stdout
        assert re.search(r"AVX2\s+[\d.]+ ms \([\d.]+x\)", line.group(2)), proc.stdout


@pytest.mark.timeout(240)
def test_step_sizes_records_every_step_of_an_offline_run(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/step_sizes.py, kvrelay only on the tiny model (a smoke test, not a
    timing): the run's prefill and decode-only steps and the decode steps by batch size."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "step_sizes.py"), "--model",
        str(tiny_model_dir), "--dtype", "float32", "--systems", "kvrelay", "--repeats", "1",
        "--num-requests", "6",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = re.search(
        r"^kvrelay: [\d.]+ s; (\d+) steps with prefill \([\d.]+ s, (\d+) tokens\); "
        r"(\d+) decode-only \([\d.]+ s, (\d+) rows\)$",
        proc.stdout,
        re.M,
    )
    assert run is not None, proc.stdout
    assert int(run.group(1)) >= 1 and int(run.group(3)) >= 15  # outputs of 16-64 tokens
    assert re.search(
        r"^  kvrelay decode steps of 1-8 rows: \d+, median [\d.]+ ms", proc.stdout, re.M
    )


@pytest.mark.timeout(240)
def test_step_sizes_runs_the_serving_workload(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/step_sizes.py --input-len/--output-len: every request of that shape, all
    at once (a smoke test): all prompt tokens prefilled, one decode row per output token
    after the first."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "step_sizes.py"), "--model",
        str(tiny_model_dir), "--dtype", "float32", "--systems", "kvrelay", "--repeats", "1",
        "--num-requests", "3", "--input-len", "24", "--output-len", "5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "3 requests of 24 -> 5 tokens" in proc.stdout, proc.stdout
    run = re.search(
        r"\(([\d.]+) s, (\d+) tokens\); (\d+) decode-only \([\d.]+ s, (\d+) rows\)", proc.stdout
    )
    assert run is not None, proc.stdout
    assert int(run.group(2)) == 3 * 24 and int(run.group(4)) == 3 * 4, proc.stdout


@pytest.mark.timeout(180)
def test_gil_priority_reports_each_case(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/gil_priority.py with one busy process (a smoke test, not a timing): the
    grammar tables and the packing, each at both priorities, with their longest gaps."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "gil_priority.py"), "--model",
        str(tiny_model_dir), "--hogs", "1", "--repeats", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for work in ("grammar", "pack"):
        for priority in ("normal priority", "nice 10"):
            line = rf"^{work} at {priority}: [\d.]+ s, longest gap ([\d.]+) s \([\d., ]+\)$"
            found = re.search(line, proc.stdout, re.M)
            assert found is not None and float(found.group(1)) > 0, proc.stdout


@pytest.mark.timeout(120)
def test_sampling_benchmark_times_every_mode(tmp_path: Path) -> None:
    """benchmarks/sampling.py on a small vocabulary (a smoke test, not a timing): a row per
    spread, mode and batch size, each with its time."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "sampling.py"), "--rows", "1", "3",
        "--vocab", "5000", "--iters", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| (flat|peaked) \| ([^|]+) \| (\d+) \| ([\d.]+) \|$", proc.stdout, re.M)
    assert len(rows) == 2 * 11 * 2, proc.stdout
    modes = {mode.strip() for _, mode, _, _ in rows}
    assert modes >= {"greedy", "top-k 50", "min-p 0.05", "temperature 1, allowed_token_ids 50"}


def test_peers_serve_reads_a_kvrelay_clusters_engine_steps(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/peers_serve.py's step reading against a real 1P+1D cluster: each worker's
    step seconds and count by role and kind, and what one request adds to them."""
    import openai

    from tests.cluster_harness import running_cluster

    module = _load_benchmark("peers_serve")
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=1, num_decode=1) as launcher:
        server = object.__new__(module.Server)  # the cluster is up: no process to start
        server.name, server.url = "kvrelay-1p1d", launcher.url
        before = server.engine_steps()
        c = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        c.completions.create(
            model="tiny", prompt="hello " * 20, max_tokens=5, extra_body={"ignore_eos": True}
        )
        after = server.engine_steps()
    steps = module.step_delta(before, after)
    prefill_s, prefills = steps["prefill/prefill"]
    decode_s, decodes = steps["decode/decode"]
    assert prefills == 1 and prefill_s > 0  # the prompt, in one step on the prefill worker
    assert decodes == 4 and decode_s > 0  # the other 4 tokens on the decode worker
    assert module.steps_brief({"decode/decode": (0.2, 4.0), "x/y": (0.0, 0.0)}) == {
        "decode/decode": "4 x 50 ms"
    }


def test_peers_serve_passes_the_clients_sampling_to_vllm_bench_serve() -> None:
    """``--temperature`` / ``--top-p`` / ``--top-k`` go to every ``vllm bench serve`` run,
    and none is sent by default (both servers then sample at temperature 1)."""
    module = _load_benchmark("peers_serve")
    plain = module.parse_args(["--model", "m"])
    assert module.sampling_argv(plain) == []
    assert "temperature 1" in module.sampling_brief(plain)
    chat = module.parse_args(["--model", "m", "--temperature", "0.7", "--top-p", "0.9"])
    assert module.sampling_argv(chat) == ["--temperature", "0.7", "--top-p", "0.9"]
    topk = module.parse_args(["--model", "m", "--top-k", "50"])
    assert module.sampling_argv(topk) == ["--top-k", "50"]


def test_prompt_logprobs_benchmark_times_and_checks(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/prompt_logprobs.py on the tiny model (a smoke test, not a timing): a row
    per length, and the comparison with transformers, which agrees."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "prompt_logprobs.py"), "--model",
        str(tiny_model_dir), "--lengths", "16", "40", "--rounds", "1", "--top", "2", "--check",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", proc.stdout, re.M)
    assert rows == ["16", "40"], proc.stdout
    found = re.search(
        r"max \|logprob difference\| ([\d.e+-]+).*same on (\d+) of (\d+)", proc.stdout
    )
    assert found is not None, proc.stdout
    assert float(found.group(1)) < 1e-3 and found.group(2) == found.group(3) == "39"


@pytest.mark.timeout(120)
def test_curve_cost_pulls_over_both_sockets(tmp_path: Path) -> None:
    """benchmarks/curve_cost.py --quick (a smoke test, not a timing): a row with both rates."""
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "curve_cost.py"), "--quick", "--repeats",
           "1", "--no-write"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = re.search(r"^\| small \| 256 \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|", proc.stdout, re.M)
    assert row is not None, proc.stdout
    assert float(row.group(1)) > 0 and float(row.group(2)) > 0


@pytest.mark.timeout(300)
def test_priority_benchmark_runs_both_policies(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/priority.py on the tiny model (a smoke test, not a timing): a row a policy."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "priority.py"), "--model",
        str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--rounds", "1",
        "--backlog", "3", "--prompt-tokens", "20", "--output-tokens", "4", "--urgent", "1",
        "--urgent-output-tokens", "2", "--gap", "0", "--urgent-after", "0.2", "--no-write",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| (fcfs|priority) \| ([\d.]+) \|", proc.stdout, re.M)
    assert [name for name, _ in rows] == ["fcfs", "priority"], proc.stdout
    assert all(float(ttft) > 0 for _, ttft in rows)


@pytest.mark.timeout(300)
def test_lora_benchmark_runs_every_mode(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/lora.py on the tiny model with a few requests, kvrelay alone: its adapters
    load (PEFT's file format, written by the script) and every mode answers (a smoke test,
    not a timing)."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "lora.py"), "--model", str(tiny_model_dir),
        "--dtype", "float32", "--threads", "1", "--rank", "4", "--adapters", "2",
        "--num-requests", "6", "--repeats", "1", "--no-write", "--no-peer", "--max-wait-quiet",
        "0", "--decode-steps", "16",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for mode in ("base", "one adapter", "mixed: base + 2 adapters"):
        assert re.search(rf"\| {re.escape(mode)} \| [\d.]+ \([\d.]+\) \|", proc.stdout), proc.stdout


def test_spec_decode_benchmark_runs_with_and_without_drafts(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/spec_decode.py on the tiny model, kvrelay alone (a smoke test, not a timing):
    both engines answer every workload, the greedy outputs agree, and the drafting one reports
    its acceptance."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "spec_decode.py"), "--model",
        str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-tokens", "24",
        "--num-random", "4", "--repeats", "1", "--no-write", "--no-peer", "--max-wait-quiet", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"\| copy, batch of 16: tok/s \| [\d.]+ \([\d.]+\) \| [\d.]+ \(", proc.stdout)
    assert "| copy chats token-identical to kvrelay's (greedy) | 16 of 16 | 16 of 16 |" in (
        proc.stdout
    ), proc.stdout
    assert re.search(r"\| - \| \d+ / \d+ \(\d+%\) \|", proc.stdout), proc.stdout


def test_embeddings_benchmark_runs_and_agrees_with_transformers(tiny_model_dir, tmp_path: Path):
    """benchmarks/embeddings.py on the tiny model, kvrelay alone (a smoke test, not a timing):
    every workload answers, and in float32 its vectors are transformers' (cosine ~1)."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "embeddings.py"), "--model",
        str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--num-docs", "8",
        "--num-queries", "8", "--repeats", "1", "--no-write", "--no-peer", "--max-wait-quiet",
        "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"\| documents \(8, 64-512 tokens\): input tok/s \| [\d.]+ \(", proc.stdout)
    assert re.search(r"\| one 128-token input: ms \| [\d.]+ \|", proc.stdout), proc.stdout
    cosine = re.search(r"\| cosine kvrelay vs transformers: min \| ([\d.]+) \|", proc.stdout)
    assert cosine is not None and float(cosine.group(1)) > 0.99999, proc.stdout


def test_scoring_benchmark_runs_and_agrees_with_transformers(tiny_model_dir, tmp_path: Path):
    """benchmarks/scoring.py on the tiny model, kvrelay alone (a smoke test, not a timing):
    it writes the cross-encoder once, every workload answers, and in float32 its scores are
    transformers'."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "scoring.py"), "--model",
        str(tiny_model_dir), "--out", str(tmp_path), "--dtype", "float32", "--threads", "1",
        "--num-queries", "2", "--num-documents", "4", "--repeats", "1", "--no-write",
        "--no-peer", "--max-wait-quiet", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / f"{tiny_model_dir.name}-cross-encoder" / "model.safetensors").is_file()
    rerank = r"\| rerank \(2 queries of [\d,-]+ tokens x 4 docs of [\d,-]+\): pairs/s \| [\d.]+ \("
    assert re.search(rerank, proc.stdout), proc.stdout
    assert re.search(r"\| long query \([\d,]+ tokens\) x 4 docs", proc.stdout), proc.stdout
    diff = re.search(r"\| largest score difference, kvrelay vs transformers \| ([\d.e+-]+) \|",
                     proc.stdout)  # fmt: skip
    assert diff is not None and float(diff.group(1)) < 1e-5, proc.stdout


def test_peers_serve_drafting_systems_and_copy_prompts() -> None:
    """``NAME+ngram`` servers get ``--speculative-config``; the copy dataset never repeats a
    prompt across seeds (both engines cache prefixes)."""
    module = _load_benchmark("peers_serve")
    args = module.parse_args(["--model", "m", "--systems", "vllm+ngram", "kvrelay-colo+ngram"])
    assert args.systems == ["vllm+ngram", "kvrelay-colo+ngram"]
    assert json.loads(args.speculative_config)["method"] == "ngram"
    spec = _load_benchmark("spec_decode")
    first, second = spec.copy_prompts(32, 1), spec.copy_prompts(32, 2)
    assert len(set(first)) == 32 and not set(first) & set(second)


def test_peers_serve_embeddings_mode() -> None:
    """``--dataset embed``: vLLM serves with its pooling runner, the client posts to
    /v1/embeddings, and the table shows latency, requests/s and input tok/s."""
    module = _load_benchmark("peers_serve")
    args = module.parse_args(["--model", "m", "--dataset", "embed", "--input-len", "128"])
    run = {"median_e2el_ms": 10.0, "p99_e2el_ms": 20.0, "request_throughput": 5.0,
           "total_input_tokens": 2560, "duration": 2.0, "load1": (1.0, 1.5)}  # fmt: skip
    text = module.render(args, {"inf": {"vllm": [run], "kvrelay-colo": []}}, stamp="now")
    assert "| inf | vllm | 10.0 | 20.0 | 5.00 | 1,280 | 1.0-1.5 |" in text, text
    assert "--runner pooling --convert embed" in text and "random inputs of 128 tokens" in text


def test_peers_serve_rerank_mode() -> None:
    """``--dataset rerank``: vLLM's pooling runner, ``vllm-rerank`` client requests of one
    query and ``--rerank-batch`` documents, and the table of the pooled datasets."""
    module = _load_benchmark("peers_serve")
    args = module.parse_args(
        ["--model", "ce", "--dataset", "rerank", "--rerank-batch", "8", "--num-prompts", "4"]
    )
    run = {"median_e2el_ms": 10.0, "p99_e2el_ms": 20.0, "request_throughput": 5.0,
           "total_input_tokens": 2560, "duration": 2.0, "load1": (1.0, 1.5)}  # fmt: skip
    text = module.render(args, {"inf": {"kvrelay-colo": [run]}}, stamp="now")
    assert "| inf | kvrelay-colo | 10.0 | 20.0 | 5.00 | 1,280 | 1.0-1.5 |" in text, text
    assert "each one query against 8 documents" in text and "--runner pooling" in text


def test_peers_serve_waves_count_every_token_of_a_chunk() -> None:
    """A chunk may carry several tokens (a speculative step's): a request's TPOT is its time
    after the first token over its later tokens, not its chunks' mean gap."""
    module = _load_benchmark("peers_serve")
    result = {"ttfts": [1.0, 1.05], "itls": [[0.1, 0.1], [0.2]], "output_lens": [5, 2]}
    assert module.waves(result) == [(2, 1000.0, pytest.approx(125.0))]  # 50 and 200 ms


def test_peers_trace_replays_a_trace_against_a_kvrelay_cluster(tiny_model_dir, tmp_path: Path):
    """benchmarks/peers_trace.py's replay and summary against a real colocated cluster: a
    four-request Splitwise trace through ``kvrelay bench --trace``, every request served,
    and one table row of its figures (a smoke test, not a timing)."""
    from tests.cluster_harness import running_cluster

    module = _load_benchmark("peers_trace")
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,40,6\n"
        "2023-11-16 18:15:46.7805900,25,4\n"
        "2023-11-16 18:15:46.9805900,60,8\n"
        "2023-11-16 18:15:47.0805900,30,5\n"
    )
    args = module.parse_args([
        "--model", str(tiny_model_dir), "--trace", str(trace), "--max-requests", "4",
        "--time-scale", "1", "--max-prompt-tokens", "64", "--max-output-tokens", "8",
    ])  # fmt: skip
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=0, num_decode=0,
                         num_colocated=1) as launcher:  # fmt: skip
        server = object.__new__(module.Server)  # the cluster is up: no process to start
        server.name, server.url, server.model_id = "kvrelay-colo", launcher.url, "tiny"
        result = module.replay(args, server, tmp_path / "run.json", seed=1)
    assert result["num_completed"] == 4 and result["num_failed"] == 0
    assert result["total_output_tokens"] == 6 + 4 + 8 + 5  # the trace's lengths, forced
    assert result["cached_prompt_tokens"] == 0  # random prompts: nothing to reuse
    [row] = module.summarize({"kvrelay-colo": [result]})
    assert row[0] == "kvrelay-colo" and row[2].endswith("%")


def test_bf16_widened_benchmark_times_every_path(tiny_model_dir) -> None:
    """One layer of the tiny model's shapes at 9 and 16 rows: a table row for each, four
    times, and the widened result checked against torch's bfloat16 one on the way."""
    script = REPO_ROOT / "benchmarks" / "bf16_widened.py"
    cmd = [sys.executable, str(script), "--model", str(tiny_model_dir), "--rows", "9", "16",
           "--layers", "1", "--repeats", "1", "--threads", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      proc.stdout, re.M)  # fmt: skip
    assert [r[0] for r in rows] == ["9", "16"], proc.stdout
    assert "widens bfloat16 here:" in proc.stdout


@pytest.mark.timeout(240)
def test_panels_ab_compares_two_builds_of_the_kernel(tmp_path: Path) -> None:
    """benchmarks/panels_ab.py with HEAD as the base, one layer (a smoke test, not a timing):
    both builds time each row count, and the same sources give the same outputs."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "panels_ab.py"), "--base", "HEAD",
        "--layers", "1", "--rows", "5", "130", "--repeats", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rows in (5, 130):
        paired = r"[\d.]+x \([\d.]+-[\d.]+\)"
        row = rf"^\| {rows} \| [\d.]+ \| \d+ \| [\d.]+ \| \d+ \| [\d.]+x \| {paired} \| (\w+) \|$"
        found = re.search(row, proc.stdout, re.M)
        assert found is not None, proc.stdout
        # HEAD's kernel sources against the tree's: unless a change to them is under way,
        # the same sums
        assert found.group(1) == "yes" or _csrc_changed(), proc.stdout


def _csrc_changed() -> bool:
    diff = ["git", "-C", str(REPO_ROOT), "diff", "--quiet", "HEAD", "--", "kvrelay/csrc"]
    return subprocess.run(diff).returncode != 0


@pytest.mark.timeout(240)
def test_cpu_panels_compares_the_packed_kernels(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/cpu_panels.py on one layer and the tiny model (a smoke test, not a timing):
    both kernels' products, both engines per dtype with their ratio, greedy identity."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "cpu_panels.py"), "--model",
        str(tiny_model_dir), "--layers", "1", "--rows", "8", "300", "--repeats", "1",
        "--num-requests", "4",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rows in (8, 300):
        assert re.search(rf"^\| {rows} \| [\d.]+ \| \d+ \| [\d.]+ \| \d+ \| [\d.]+x \|$",
                         proc.stdout, re.M), proc.stdout  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        assert re.search(rf"^\| {dtype} \| panels / oneDNN \| [\d.]+x \|", proc.stdout, re.M)
        same = re.search(rf"{dtype}: greedy tokens identical on (\d+) of 4", proc.stdout)
        assert same is not None, proc.stdout


def test_peers_pairs_each_repeats_offline_runs() -> None:
    """peers.py's offline ratio per repeat: the two engines' runs of one repeat, divided."""
    module = _load_benchmark("peers")
    ours = [{"tokens": 100, "seconds": s} for s in (1.0, 2.0, 1.25)]  # 100, 50, 80 tok/s
    theirs = [{"tokens": 100, "seconds": s} for s in (2.0, 2.5, 1.25)]  # 50, 40, 80 tok/s
    assert module.paired_ratios(ours, theirs) == [1.0, 1.25, 2.0]
    with pytest.raises(ValueError):  # a repeat without its pair is not a pair
        module.paired_ratios(ours, theirs[:2])


@pytest.mark.timeout(300)
def test_huge_pages_benchmark_times_both_pools(tiny_model_dir, tmp_path: Path) -> None:
    """benchmarks/huge_pages.py on the tiny model (a smoke test, not a timing): a row a context,
    both engines' medians and their paired ratio."""
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "huge_pages.py"), "--model",
        str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--contexts", "8", "40",
        "--steps", "4", "--rounds", "2", "--churn", "6",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["8", "40"], proc.stdout
    assert all(float(v) > 0 for r in rows for v in r[1:]), proc.stdout
