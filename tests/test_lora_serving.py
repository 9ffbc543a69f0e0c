"""LoRA adapters served by a cluster of real processes (``--lora-modules``): a request names
an adapter as its ``model``; placement sends it only to workers holding those files; its KV
never serves the base or another adapter; and the registry's view of who holds what."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvrelay import LLM, LoRARequest, SamplingParams
from kvrelay.cli.launcher import Launcher
from kvrelay.protocol.messages import KvLayout, PeerInfo, Register, Role, decode, encode
from kvrelay.protocol.sampling_params import SamplingParams as Params
from kvrelay.router.registry import Registry
from tests.cluster_harness import TOPOLOGIES, metric_value, read_text, running_cluster
from tests.lora_adapters import make_adapter

PROMPT = "Once upon a time, in a land far away, there lived a"
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # several 16-token blocks


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "sql", seed=3)


@pytest.fixture(scope="module", params=["colocated", "1P+1D"])
def cluster(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    adapter_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Launcher]:
    counts = TOPOLOGIES[request.param]
    worker_args = ("--num-blocks", "512", "--threads", "1", "--lora-modules", f"sql={adapter_dir}")
    with running_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("lora-cluster"), worker_args=worker_args,
        **counts,
    ) as launcher:  # fmt: skip
        yield launcher


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path, adapter_dir: Path) -> dict[str | None, list[int]]:
    """Greedy token ids of PROMPT, offline: the base (None) and the adapter ("sql")."""
    llm = LLM(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = {}
    for name in (None, "sql"):
        lora = None if name is None else LoRARequest(name, 1, str(adapter_dir))
        out[name] = llm.generate(PROMPT, params, lora_request=lora)[0].outputs[0].token_ids
    assert out[None] != out["sql"]  # the adapter changes the answer
    return out


def _client(launcher: Launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)


def _token_ids(launcher: Launcher, model: str, stream: bool = False) -> list[int]:
    kwargs: dict[str, Any] = {
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True},
    }  # fmt: skip
    client = _client(launcher)
    if not stream:
        tokens = client.completions.create(**kwargs).choices[0].logprobs.tokens
    else:
        tokens = []
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.timeout(180)
def test_a_request_naming_the_adapter_runs_through_it(cluster: Launcher, offline) -> None:
    def placed_through_sql() -> float:
        metrics = read_text(cluster.url + "/metrics")
        return metric_value(metrics, "kvrelay_lora_requests_total", adapter="sql")

    before = placed_through_sql()
    assert _token_ids(cluster, "sql") == offline["sql"]
    assert _token_ids(cluster, "sql", stream=True) == offline["sql"]
    assert _token_ids(cluster, "tiny") == offline[None]
    chat = _client(cluster).chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "sql" and chat.usage is not None and chat.usage.completion_tokens >= 1
    assert placed_through_sql() == before + 3  # two completions and a chat


@pytest.mark.timeout(120)
def test_models_lists_the_adapter_and_unknown_names_are_404(cluster: Launcher) -> None:
    models = {m.id: m for m in _client(cluster).models.list().data}
    assert set(models) == {"tiny", "sql"}
    assert models["sql"].parent == "tiny"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as caught:
        _client(cluster).completions.create(model="sqll", prompt="x", max_tokens=1)
    assert "Served: tiny, sql" in str(caught.value)
    instances = cluster.get_json("/admin/instances")["data"]
    assert all(list(i["lora_adapters"]) == ["sql"] for i in instances)


@pytest.mark.timeout(120)
def test_the_adapter_never_reuses_the_bases_kv(cluster: Launcher) -> None:
    client = _client(cluster)

    def cached(model: str) -> int:
        usage = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=1).usage
        assert usage is not None
        details = usage.prompt_tokens_details
        return 0 if details is None else details.cached_tokens or 0

    assert cached("tiny") == 0
    assert cached("tiny") > 0  # the base's own blocks
    assert cached("sql") == 0  # same prompt, other weights: nothing of the base's
    assert cached("sql") > 0  # its own


# ------------------------------------------------------------------ the router's registry

LAYOUT = KvLayout(2, 64, 16, 2, 8, "float32")


def _register(registry: Registry, instance_id: str, role: Role, **loras: bytes) -> None:
    info = PeerInfo(instance_id, role, "A", f"tcp://{instance_id}:1", "", None, LAYOUT, b"f")
    msg = decode(encode(Register(info, "tiny", 4096, 1, lora_adapters=loras)), Register)
    registry.register(msg)


def test_placement_takes_only_workers_that_hold_the_adapter() -> None:
    registry = Registry()
    _register(registry, "plain", Role.COLOCATED)
    _register(registry, "holder", Role.COLOCATED, sql=b"a" * 16)
    assert registry.lora_adapters() == {"sql": b"a" * 16}
    placement = registry.place(num_prompt_tokens=8)
    assert placement is not None and placement.prefill.instance_id == "plain"
    placement = registry.place(num_prompt_tokens=8, lora=("sql", b"a" * 16))
    assert placement is not None and placement.prefill.instance_id == "holder"
    assert registry.place(num_prompt_tokens=8, lora=("sql", b"b" * 16)) is None
    registry.remove("holder")
    assert registry.lora_adapters() == {}
    assert registry.place(num_prompt_tokens=8, lora=("sql", b"a" * 16)) is None
    registry.check_integrity()


def test_a_hand_off_pairs_only_workers_with_the_adapter() -> None:
    registry = Registry()
    _register(registry, "p0", Role.PREFILL, sql=b"a" * 16)
    _register(registry, "d-plain", Role.DECODE)
    _register(registry, "d-sql", Role.DECODE, sql=b"a" * 16)
    placement = registry.place(num_prompt_tokens=8, lora=("sql", b"a" * 16))
    assert placement is not None and placement.decode is not None
    assert placement.decode.instance_id == "d-sql"
    registry.check_integrity()


def test_other_files_under_a_served_name_are_never_used() -> None:
    registry = Registry()
    _register(registry, "first", Role.COLOCATED, sql=b"a" * 16)
    _register(registry, "other", Role.COLOCATED, sql=b"b" * 16, extra=b"c" * 16)
    other = registry.get("other")
    assert other is not None
    assert other.as_dict()["conflicting_lora_adapters"] == ["sql"]
    assert other.as_dict()["lora_adapters"] == {"extra": (b"c" * 16).hex()}
    for _ in range(3):
        placement = registry.place(num_prompt_tokens=8, lora=("sql", b"a" * 16))
        assert placement is not None and placement.prefill.instance_id == "first"
        registry.assign(placement)
    registry.check_integrity()


def test_the_adapter_name_is_a_later_sampling_field() -> None:
    assert Params(lora_name="sql").fields_set() == {"lora_name"}
    with pytest.raises(ValueError, match="lora_name"):
        Params(lora_name="")


# ------------------------------------------------------------------ runtime loading


@pytest.fixture(scope="module")
def updatable(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """1P+1D, no adapter at start, the router serving vLLM's runtime LoRA endpoints."""
    router_args = ("--dead-after", "1.5", "--served-model-name", "tiny",
                   "--allow-runtime-lora-updating")  # fmt: skip
    with running_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("lora-runtime"), num_prefill=1, num_decode=1,
        num_colocated=0, router_args=router_args,
    ) as launcher:  # fmt: skip
        yield launcher


def _post(launcher: Launcher, path: str, body: dict[str, Any]) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        launcher.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _held(launcher: Launcher) -> list[list[str]]:
    return [sorted(i["lora_adapters"]) for i in launcher.get_json("/admin/instances")["data"]]


@pytest.mark.timeout(180)
def test_an_adapter_loaded_at_runtime_serves_and_unloads(
    updatable: Launcher, adapter_dir: Path, offline, tmp_path: Path
) -> None:
    status, text = _post(updatable, "/v1/load_lora_adapter",
                         {"lora_name": "sql", "lora_path": str(adapter_dir)})  # fmt: skip
    assert (status, text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert _held(updatable) == [["sql"], ["sql"]]  # prefill and decode
    assert {m.id for m in _client(updatable).models.list().data} == {"tiny", "sql"}
    assert _token_ids(updatable, "sql") == offline["sql"]
    status, text = _post(updatable, "/v1/load_lora_adapter",
                         {"lora_name": "sql", "lora_path": str(adapter_dir)})  # fmt: skip
    assert status == 400 and "already been loaded" in text

    status, text = _post(updatable, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert _held(updatable) == [[], []]
    with pytest.raises(openai.NotFoundError):
        _token_ids(updatable, "sql")
    status, text = _post(updatable, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "cannot be found" in text

    # a path that holds no adapter: refused with the worker's reason, loaded nowhere
    status, text = _post(updatable, "/v1/load_lora_adapter",
                         {"lora_name": "bad", "lora_path": str(tmp_path / "none")})  # fmt: skip
    assert status == 400 and "LoRA adapter directory not found" in text, text
    assert _held(updatable) == [[], []]
    status, text = _post(updatable, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "'lora_path' must be a non-empty string" in text
    status, text = _post(updatable, "/v1/load_lora_adapter",
                         {"lora_name": "tiny", "lora_path": str(adapter_dir)})  # fmt: skip
    assert status == 400 and "the base model's name" in text


@pytest.mark.timeout(120)
def test_runtime_loading_is_off_unless_the_router_allows_it(
    cluster: Launcher, adapter_dir: Path
) -> None:
    status, text = _post(cluster, "/v1/load_lora_adapter",
                         {"lora_name": "more", "lora_path": str(adapter_dir)})  # fmt: skip
    assert status == 403 and "--allow-runtime-lora-updating" in text
    assert all(
        list(i["lora_adapters"]) == ["sql"] for i in cluster.get_json("/admin/instances")["data"]
    )


def test_a_failed_load_is_undone_everywhere_and_joiners_get_runtime_adapters() -> None:
    """LoRAAdmin against a registry: one worker fails, the one that loaded unloads again; a
    loaded adapter is pushed to a worker that joins later."""
    import asyncio

    from kvrelay.protocol.messages import LoRAState, LoRAUpdate
    from kvrelay.router.errors import ApiError
    from kvrelay.router.lora_admin import LoRAAdmin

    registry = Registry()
    _register(registry, "w0", Role.COLOCATED)
    _register(registry, "w1", Role.COLOCATED)
    sent: list[tuple[str, LoRAUpdate]] = []
    admin = LoRAAdmin(registry, lambda inst, msg: sent.append((inst.instance_id, msg)))
    fp = b"a" * 16

    async def answer(errors: dict[str, str]) -> None:
        while len(sent) < 2:
            await asyncio.sleep(0)
        for instance_id, msg in list(sent):
            error = errors.get(instance_id, "")
            held = {} if error or msg.unload else {msg.name: fp}
            admin.on_state(b"", LoRAState(instance_id, held, msg.request_id, error))

    async def load(errors: dict[str, str]) -> None:
        sent.clear()
        await asyncio.gather(admin.load("sql", "/adapters/sql"), answer(errors))

    with pytest.raises(ApiError, match="failed on w1: no such file"):
        asyncio.run(load({"w1": "no such file"}))
    assert ("w0", LoRAUpdate("sql", unload=True)) in sent  # undone where it had loaded
    assert admin.runtime == {}
    assert registry.lora_adapters() == {"sql": fp}  # until w0 says it unloaded
    admin.on_state(b"", LoRAState("w0", {}))
    assert registry.lora_adapters() == {}
    asyncio.run(load({}))
    assert admin.runtime == {"sql": "/adapters/sql"}
    assert registry.lora_adapters() == {"sql": fp}
    sent.clear()
    _register(registry, "w2", Role.COLOCATED)
    joined = registry.get("w2")
    assert joined is not None
    admin.on_register(joined)
    assert sent == [("w2", LoRAUpdate("sql", "/adapters/sql"))]
    registry.check_integrity()
