"""Scale-up benchmark, report: the verdicts on each goal, the notes on where the time goes,
and the BENCHMARKS.md section (``markdown_body``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common import machine_markdown, markdown_table, median
from scale_up_measure import MODES, AttachResult, ChainRun, StartRun, link_label
from scale_up_setup import Checkpoint
from scale_up_tables import (
    ATTACH_HEADERS,
    CHAIN_HEADERS,
    START_HEADERS,
    Results,
    attach_rows,
    by_link,
    chain_bytes,
    chain_p50,
    chain_rows,
    median_of,
    mib,
    parse_results,
    start_rows,
)

from kvrelay.transport.rate_limit import mbps_to_bytes_per_s

GOAL_ATTACH_MS = 100.0
GOAL_FLAT = 2.0  # "flat": the slowest model's attach within this factor of the fastest's
GOAL_CHAIN_RATIO = 1.5


def verdicts(
    attach: Sequence[AttachResult],
    starts: Sequence[StartRun],
    chain: Sequence[ChainRun],
    chain_bytes: int = 0,
) -> list[str]:
    lines = [attach_verdict(attach)] if attach else []
    lines += [start_verdict(model, starts) for model in dict.fromkeys(r.model for r in starts)]
    for group in by_link(chain).values():
        sizes = {r.num_receivers for r in group}
        if 1 in sizes and len(sizes) > 1:
            lines.append(chain_verdict(group, chain, chain_bytes))
    return lines


def attach_verdict(attach: Sequence[AttachResult]) -> str:
    p50 = {a.model: median(a.attach_ms) for a in attach}
    slowest, fastest = max(p50.values()), min(p50.values())
    sizes = [a.pool_bytes for a in attach]
    return (
        f"- Pool attach: {', '.join(f'{m} {v:.1f} ms' for m, v in p50.items())} (p50); "
        f"goal < {GOAL_ATTACH_MS:.0f} ms: {'met' if slowest < GOAL_ATTACH_MS else 'MISSED'}. "
        f"Flat in size: the pools span {max(sizes) / min(sizes):.0f}x in bytes, attach "
        f"{slowest / fastest:.2f}x in time (goal <= {GOAL_FLAT:.0f}x): "
        f"{'met' if slowest / fastest <= GOAL_FLAT else 'MISSED'}."
    )


def start_verdict(model: str, starts: Sequence[StartRun]) -> str:
    t = {
        m: median_of([r.first_token_s for r in starts if r.model == model and r.mode == m])
        for m in MODES
    }
    parts = ", ".join(f"{m} {v:.2f} s" for m, v in t.items() if v is not None)
    gain = ""
    if t["disk"] and t["pool"]:
        saved = t["disk"] - t["pool"]
        what = f"{saved:.2f} s less" if saved >= 0 else f"{-saved:.2f} s more"
        gain = f"; the host pool takes {what} than disk ({t['disk'] / t['pool']:.2f}x)"
    return f"- {model}, start to first token: {parts}{gain}."


def chain_verdict(group: Sequence[ChainRun], chain: Sequence[ChainRun], num_bytes: int) -> str:
    """The goal's verdict for one link condition (``group``) and why, from the numbers: the
    pool bytes delivered per second summed over receivers, against the link and against the
    unlimited runs (``chain``) of the same ``num_bytes`` pool."""
    p50s = chain_p50(group)
    most, link_mbps = max(p50s), group[0].link_mbps
    ratio = p50s[most] / p50s[1]
    rate = {n: n * num_bytes / t / 1e9 for n, t in p50s.items()}  # GB/s, all receivers
    text = (
        f"- Chain, {link_label(link_mbps)}: {most} receivers in {p50s[most]:.2f} s vs 1 in "
        f"{p50s[1]:.2f} s = {ratio:.2f}x (goal < {GOAL_CHAIN_RATIO}x): "
        f"{'met' if ratio < GOAL_CHAIN_RATIO else 'MISSED'}"
    )
    if link_mbps == 0:
        if rate[most] < 0.75 * most * rate[1]:
            return text + (
                f". CPU-bound: {most} receivers together take in {rate[most]:.2f} GB/s, one "
                f"alone {rate[1]:.2f} GB/s, so every hop's receive, checksum and write queues "
                "on the same cores (see the notes)."
            )
        return text + ". The hops overlap: the CPUs did not set the time at this size."
    link_gbs = mbps_to_bytes_per_s(link_mbps) / 1e9
    text += (
        f". One transfer at the link is {num_bytes / 1e9 / link_gbs:.2f} s; {most} receivers "
        f"take in {rate[most]:.2f} GB/s together ({most} x {link_gbs:.3f} GB/s links = "
        f"{most * link_gbs:.2f} GB/s)"
    )
    unlimited = chain_p50([r for r in chain if r.link_mbps == 0])
    cpu_gbs = most * num_bytes / unlimited[most] / 1e9 if most in unlimited else None
    if cpu_gbs is not None:
        text += f", against the {cpu_gbs:.2f} GB/s the CPUs reached unlimited"
    if ratio < GOAL_CHAIN_RATIO:
        return text + (
            ": the link, not the CPUs, sets the time, and the chain adds "
            f"{p50s[most] - p50s[1]:.2f} s for {most - 1} more hop(s), forwarding chunks as "
            "they arrive."
        )
    if cpu_gbs is not None and rate[most] > 0.75 * cpu_gbs:
        return text + ": still CPU-bound, the link rate is too close to this machine's limit."
    return text + (
        f": neither the link nor the CPUs explain the {p50s[most] - p50s[1]:.2f} s the extra "
        "hops add; see the per-receiver times."
    )


def describe(
    settings: dict[str, Any], ckpts: Sequence[Checkpoint], chain_ckpt: Checkpoint | None
) -> str:
    models = "; ".join(
        f"`{c.name}` {c.num_params:,} params in {c.dtype} ({mib(c.num_bytes)} MiB)" for c in ckpts
    )
    repeats, blocks = settings["repeats"], settings["num_blocks"]
    text = (
        f"Models: {models}. `small` and `medium` are make_tiny llama checkpoints; `1b` is a "
        "random Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV "
        "heads, MLP 5632) with the small tokenizer's 8,192-token vocabulary, written once "
        f"into `{settings['cache_dir']}` and kept there between runs. Times are medians of "
        f"{repeats} repeat(s). Page cache: **dropped**, per file: before every start and "
        "every in-process disk load the checkpoint's weight file is evicted with "
        "`posix_fadvise(DONTNEED)` (no process maps it: the cluster's own workers load a "
        "byte copy in other files), and `fincore` confirms it (bytes resident below); "
        "Python, torch and kvrelay's own files stay warm, and the virtual disk may be cached "
        "by the hypervisor.\n\n"
        "**Start to first token.** One cluster per model: router + 1 prefill + 1 decode "
        f"(`--threads 1 --num-blocks {blocks}`, KV over shm), its original workers on "
        "`--no-param-pool` so that they never hold the host's pool. For each mode the "
        "current prefill worker is drained and stopped, one prefill worker is started with "
        "the mode's flags, and the clock runs from `Launcher.add_worker` to the first "
        "streamed event of a 1-token completion that only the new worker can prefill "
        "(checked with its device-cache counters, and its log must show the pool event the "
        "mode expects). **disk**: `--no-param-pool`. **build**: the first instance on a "
        "host: no pool yet, it loads from disk and writes the host's pool. **pool**: the "
        "host's pool is ready (the build worker's, or made beforehand): attach. **peer**: "
        "no pool on this host; `--param-peers` names a `kvrelay pool serve` of the model "
        "under another scope (another host, emulated on this one), so the worker fills this "
        "host's pool from it over ZMQ/TCP loopback. 'worker ready': the worker's `ready` log "
        "line (process start, imports, config, weights, KV cache, registration sent); "
        "'router lists it': `/admin/instances` shows it. weights: for build and peer, the "
        "time the worker logged for building / filling the pool; (a) `load_weights` in this "
        "script's process with the file evicted; (b) pool attach, from the next table.\n\n"
        "**Pool attach alone**: `ParamPool.attach_or_create` + `close` on a ready pool, "
        f"{settings['attach_repeats']} times after one warm-up, in this script's process. "
        "It includes `model_identity` (every byte of the weights, config and tokenizer files; "
        "file digests cached by inode, size, mtime and ctime, so here only stat calls) and "
        "the `gc` sweep that runs first; the tensors are views of the mapping, so "
        "pages are faulted in later, by the first forward pass (in 'first token after "
        "join')."
    )
    if chain_ckpt is not None:
        text += (
            f"\n\n**Chain multicast** of the largest pool whose copies fit in memory, "
            f"`{chain_ckpt.name}` ({mib(chain_ckpt.num_bytes)} MiB, {chain_ckpt.dtype}), "
            "from a `kvrelay pool serve` to N receivers, each a process with its own "
            "pool scope that serves what it has received onward (`fetch_pool(..., "
            "forward_bind=...)`, sources in `plan_chain` order). The receivers start, import "
            "and fingerprint the model first; then all begin at one signal, and the time is "
            "from the signal to the last receiver's pool ready (every 4 MiB chunk "
            "checksummed). 'chain order kept': every receiver pulled from its predecessor "
            "alone (no failover to an earlier hop). Two conditions, each from its own origin: "
            "**unlimited** (loopback as fast as the CPUs go) and **link-limited** "
            f"(`--link-mbps {settings.get('link_mbps', 0):g}`: the origin and every forwarding "
            "receiver send at most that rate)."
        )
    return text


def time_notes(r: Results, import_s: float | None) -> str:
    """Where a start's time goes, with this run's numbers for its largest model."""
    big = max(r.ckpts, key=lambda c: c.num_bytes)
    runs = [s for s in r.starts if s.model == big.name]
    attach = next((a for a in r.attach if a.model == big.name), None)
    if not runs or attach is None or import_s is None:
        return ""
    after = median([s.first_token_s - s.joined_s for s in runs])
    logged = {
        m: median_of([s.weights_logged_s for s in runs if s.mode == m]) for m in ("build", "peer")
    }
    pool_ready = median_of([s.ready_s for s in runs if s.mode == "pool"])
    text = f"Where the time goes, for `{big.name}`: "
    if pool_ready is not None:
        text += (
            f"a worker that attaches the host's pool is ready {pool_ready:.2f} s after it is "
            "started, nearly all of it process start and the imports of torch and kvrelay (a "
            f"bare interpreter importing the worker's modules took {import_s:.2f} s, median "
            "at the run's start); "
        )
    text += (
        f"the first forward pass after it joins ({after:.2f} s: one thread, the pool's "
        "pages faulted in on first use) is the same in every mode. The weights are what "
        f"differ: attaching the pool takes {median(attach.attach_ms):.1f} ms against "
        f"{median(attach.disk_load_s):.2f} s to load from disk"
    )
    if logged["build"] is not None:
        text += f"; the first instance on a host builds the pool in {logged['build']:.2f} s"
    if logged["peer"] is not None:
        rate = big.num_bytes / logged["peer"] / 1e9
        disk_rate = big.num_bytes / median(attach.disk_load_s) / 1e9
        text += (
            f"; a peer fills it in {logged['peer']:.2f} s ({rate:.2f} GB/s over loopback "
            f"TCP, checksums included), {'slower' if rate < disk_rate else 'faster'} than "
            f"this machine's disk ({disk_rate:.2f} GB/s cold from a virtual disk, casts and "
            "fusing included): a peer pays off where the network is faster than the "
            "checkpoint's storage (network or object storage, a slow local disk)"
        )
    return text + (
        ". For the smaller models the weights are a small part of a start dominated by the "
        "imports, and mode-to-mode differences of a few hundred ms there are within the "
        "spread of repeats (min - max) on this shared machine."
    )


def chain_notes(r: Results, num_cpus: int) -> str:
    """What the two chain conditions mean, with this run's rates and how the link was chosen."""
    assert r.chain_ckpt is not None
    num_bytes = r.chain_ckpt.num_bytes
    groups = by_link(r.chain)
    unlimited = chain_p50(groups.get(0.0, []))
    rates = {n: n * num_bytes / t / 1e9 for n, t in unlimited.items()}  # GB/s, all receivers
    most = max(rates, default=None)
    text = (
        "What the chain numbers mean on this machine. Unlimited: the origin, every receiver "
        f"and this script share its {num_cpus} CPUs, and each hop costs CPU for a loopback "
        "TCP send and receive, a checksum and first-touch page faults into a new shared-memory "
        "segment. The bytes delivered per second, summed over receivers, are "
        f"{' / '.join(f'{v:.2f}' for v in rates.values())} GB/s for "
        f"{' / '.join(map(str, rates))} receivers: "
    )
    if most is not None and rates[most] >= 0.6 * most * rates[min(rates)]:
        text += (
            "they grow with N, so the hops overlap (each receiver forwards chunks as they "
            "arrive) and the cores keep up. "
        )
    else:
        text += "flat: the cores, not the chain's serial hops, set the time, and it grows with N. "
    text += (
        "Between hosts each hop has its own CPUs and NIC and the transfer is link-bound: N "
        "receivers take about one transfer plus (N - 1) chunk times (4 MiB chunks) plus a "
        "connect per hop (a receiver can connect only once its predecessor has the header and "
        "binds; ZMQ retries every 100 ms)."
    )
    for link_mbps in (m for m in groups if m > 0):
        link = mbps_to_bytes_per_s(link_mbps)
        text += (
            f" Link-limited ({link_mbps:g} Mbps = {link / 1e6:.0f} MB/s) models that: the "
            "origin and every forwarding receiver pace their chunk data with a token bucket "
            "(no burst: a chunk leaves only once the previous one's bytes have had their "
            f"time on the link, {1e3 * (4 << 20) / link:.0f} ms per 4 MiB chunk), one "
            "NIC per host; loopback adds no propagation delay, so only serialisation is "
            "modelled. "
        )
        if most is not None:
            share = link / (rates[most] * 1e9 / most)
            below = "well below" if share <= 0.35 else "below" if share < 1 else "NOT below"
            text += (
                f"The link rate is {below} this machine's limit in this run: unlimited, {most} "
                f"receivers took in {rates[most]:.2f} GB/s together, {rates[most] / most:.3f} "
                f"GB/s each, and the link is {share:.0%} of that, so {most} hops receiving at "
                "the link rate leave the cores spare when it is well below."
            )
    return text


def markdown_body(result: dict[str, Any]) -> str:
    r = parse_results(result)
    by_model = {a.model: a for a in r.attach}
    resident = [s.resident_bytes for s in r.starts if s.resident_bytes is not None]
    parts = [describe(result["settings"], r.ckpts, r.chain_ckpt)]
    if r.starts:
        parts.append(markdown_table(START_HEADERS, start_rows(r.ckpts, r.starts, by_model)))
        parts.append(
            "Checkpoint bytes resident in the page cache when a worker started: at most "
            f"{max(resident, default=0):,}."
        )
    if r.attach:
        parts.append(markdown_table(ATTACH_HEADERS, attach_rows(r.attach)))
    if r.chain_ckpt is not None:
        parts.append(markdown_table(CHAIN_HEADERS, chain_rows(r.chain_ckpt, r.chain)))
    parts.append("\n".join(verdicts(r.attach, r.starts, r.chain, chain_bytes(r))))
    parts.append(time_notes(r, result["import_s"]))
    if r.chain_ckpt is not None and r.chain:
        parts.append(chain_notes(r, result["machine"]["num_cpus"]))
    load = result["load_average"]
    parts.append(
        f"1-min load average at start / end: {load[0]:.1f} / {load[1]:.1f} "
        f"({result['machine']['num_cpus']} CPUs; other jobs shared the machine when this is "
        "above that)."
    )
    parts.append(machine_markdown(result["machine"]))
    return "\n\n".join(p for p in parts if p)
