"""The autoscaler: in-process over a real router backend, then with the local hook and
real processes.

The ramp: load rises (decode runs at most two sequences, so hand-offs queue up), the policy
adds a decode instance, which joins and serves; load stops, it is drained and removed. An
operator then forces a count up and, under load, down again. No request fails and each
gets every token; ``/admin/autoscaler`` shows the decisions and their reasons; bad updates
get 400, no token 401.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from kvrelay.autoscale.autoscaler import Autoscaler, AutoscalerSettings, UpdateError
from kvrelay.autoscale.base import HookError, ScaleDecision, ScalingHook
from kvrelay.autoscale.policy import Policy, PolicyConfig, RoleTarget
from kvrelay.cli.launcher import Launcher
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.messages import KvLayout, LoadReport, PeerInfo, Register, Role
from kvrelay.router.dispatcher import Dispatcher, DispatcherSettings
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.transport.curve import SocketSecurity
from kvrelay.worker.cpu_priority import DECODE_NICE
from tests.cluster_harness import admin_request, metric_value, read_text, running_cluster

TOKEN = "autoscale-s3cret"
MAX_TOKENS = 16
NUM_CLIENTS = 6
WORKER_ARGS = ("--num-blocks", "512", "--threads", "1", "--max-num-seqs", "2")
POLICY = {
    "window_s": 10,
    "decode": {
        "max_queue_per_instance": 1,
        "up_after": 2,
        "down_after": 4,
        "cooldown_up_s": 5,
        "cooldown_down_s": 3,
        "scale_down_below": 0.5,
    },
}


def router_args(cluster_id: str, log_dir: str) -> tuple[str, ...]:
    hook = {
        "worker_args": [*WORKER_ARGS, "--host-pool", f"kvrelay-{cluster_id}-l1"],
        "log_dir": log_dir,
        "standby": 1,
    }
    return (
        "--dead-after", "1.5",
        "--served-model-name", "tiny",
        "--cluster-id", cluster_id,
        "--autoscale", "local",
        "--autoscale-options", json.dumps(hook),
        "--autoscale-interval", "0.5",
        "--autoscale-policy", json.dumps(POLICY),
        "--min-prefill", "1", "--max-prefill", "1",
        "--min-decode", "1", "--max-decode", "2",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
    )  # fmt: skip


def admin(launcher: Launcher, method: str = "GET", body: Any = None, token: str | None = TOKEN):
    """(status, JSON body) of /admin/autoscaler."""
    return admin_request(launcher, "/admin/autoscaler", method, body, token)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def instances(launcher: Launcher) -> dict[str, dict[str, Any]]:
    return {i["instance_id"]: i for i in launcher.get_json("/admin/instances")["data"]}


def owned(launcher: Launcher) -> dict[str, dict[str, Any]]:
    return admin(launcher)[1]["hook"]["instances"]


class Load:
    """``NUM_CLIENTS`` threads streaming completions back to back until ``stop()``."""

    def __init__(self, launcher: Launcher) -> None:
        self.url = launcher.url + "/v1"
        self.done = threading.Event()
        self.completion_tokens: list[int] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(NUM_CLIENTS)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)
        n = 0
        while not self.done.is_set():
            n += 1
            try:
                stream = client.completions.create(
                    model="tiny",
                    prompt=f"client {i} request {n}: the load rises and falls",
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage = [chunk.usage for chunk in stream if chunk.usage is not None]
                self.completion_tokens.append(usage[-1].completion_tokens)
            except openai.APIError as e:
                self.errors.append(repr(e))

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=120)


def served_steps(instance: dict[str, Any]) -> float:
    """Engine steps the instance ran (it steps only with requests)."""
    return metric_value(
        read_text(instance["status_url"] + "/metrics"), "kvrelay_engine_step_seconds_count"
    )


def test_ramp_adds_then_drains_and_removes_a_decode_instance(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_ADMIN_TOKEN", TOKEN)  # the router reads it; so does get_json
    cluster_id = f"as{os.getpid()}-{uuid.uuid4().hex[:6]}"
    with running_cluster(
        tiny_model_dir,
        tmp_path,
        cluster_id=cluster_id,
        worker_args=WORKER_ARGS,
        router_args=router_args(cluster_id, str(tmp_path)),
    ) as launcher:
        status, state = admin(launcher)
        assert status == 200 and state["enabled"] and state["hook"]["name"] == "local"
        assert state["targets"]["decode"]["max_instances"] == 2
        assert state["hook"]["instances"] == {}

        # load rises: a decode instance is added and serves requests
        load = Load(launcher)
        try:
            new_id = wait_for("a decode instance added", lambda: next(iter(owned(launcher)), None))
            assert new_id.startswith("decode-as")
            added = wait_for("it to join", lambda: instances(launcher).get(new_id))
            wait_for("it to serve", lambda: served_steps(added) > 0, timeout=60)
        finally:
            load.stop()
        assert load.errors == []
        assert load.completion_tokens and set(load.completion_tokens) == {MAX_TOKENS}

        # load falls: it is drained, stopped and leaves the router
        wait_for("it to be removed", lambda: not owned(launcher))
        wait_for("it to leave the router", lambda: new_id not in instances(launcher))
        assert not _alive(added["pid"])
        decisions = admin(launcher)[1]["recent_decisions"]
        up = [d for d in decisions if d["decode"] == 2 and d["current_decode"] == 1]
        down = [d for d in decisions if d["drain"] == [new_id]]
        assert up and up[0]["status"] == "applied" and not up[0]["forced"]
        assert up[0]["reasons"][0].startswith("decode 1->2: queue "), up[0]
        assert down and down[0]["status"] == "applied"
        assert down[0]["reasons"][0].startswith("decode 2->1: TPOT attainment"), down[0]
        assert down[0]["reasons"][0].endswith(f"draining {new_id}")

        _check_operator_controls(launcher)


def _check_operator_controls(launcher: Launcher) -> None:
    assert admin(launcher, token=None)[0] == 401
    assert admin(launcher, "POST", {"enabled": False}, token=None)[0] == 401
    for body, param in (
        ({"force": {"decode": 5}}, "force.decode"),
        ({"min": {"decode": 3}}, "min.decode"),
        ({"enabled": "yes"}, "enabled"),
        ({"max": {"router": 1}}, "max"),
        ({"scale": 1}, "scale"),
    ):
        status, err = admin(launcher, "POST", body)
        assert (status, err["error"]["param"]) == (400, param), (body, err)
        assert err["error"]["type"] == "invalid_request_error"
    status, state = admin(launcher, "POST", {"enabled": False, "force": {"decode": 2}})
    assert status == 200 and not state["enabled"] and state["forced"] == {"decode": 2}

    # a forced count holds even while disabled; the warm standby takes the new role
    new_id = wait_for("a forced decode instance", lambda: next(iter(owned(launcher)), None))
    added = wait_for("it to join", lambda: instances(launcher).get(new_id))
    # on the router's host with the prefill workers: it yields the cores to prefill (--cpu-nice)
    pid = owned(launcher)[new_id]["pid"]
    base = os.getpriority(os.PRIO_PROCESS, 0)
    tasks = Path(f"/proc/{pid}/task").iterdir()
    nices = {int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks}
    assert nices == {base + DECODE_NICE}
    # forced down while it serves: it drains, its requests finish, none fails
    load = Load(launcher)
    try:
        wait_for("it to serve", lambda: served_steps(added) > 0, timeout=60)
        status, state = admin(launcher, "POST", {"force": {"decode": 1}})
        assert status == 200 and state["forced"] == {"decode": 1}
        wait_for("it to be removed", lambda: not owned(launcher))
    finally:
        load.stop()
    assert load.errors == []
    assert load.completion_tokens and set(load.completion_tokens) == {MAX_TOKENS}
    wait_for("it to leave the router", lambda: new_id not in instances(launcher))
    status, state = admin(launcher, "POST", {"enabled": True, "force": {"decode": None}})
    assert status == 200 and state["enabled"] and state["forced"] == {}
    forced = [d for d in state["recent_decisions"] if d["forced"]]
    assert [d["reasons"] for d in forced] == [
        ["decode 1->2: forced by the operator"],
        [f"decode 2->1: forced to 1 by the operator; draining {new_id}"],
    ]
    assert state["errors"] == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- in-process, no workers


class RecordingHook(ScalingHook):
    """Records decisions; owns the instances named ``*-as*`` (as the local hook would)."""

    name = "recording"

    def __init__(self, error: str | None = None) -> None:
        self.applied: list[ScaleDecision] = []
        self.error = error
        self.closed = False

    def apply(self, decision: ScaleDecision) -> None:
        if self.error:
            raise HookError(self.error)
        self.applied.append(decision)

    def owns(self, instance_id: str) -> bool:
        return "-as" in instance_id

    def describe(self) -> dict[str, Any]:
        return {"applied": len(self.applied)}

    def close(self) -> None:
        self.closed = True


QUICK = PolicyConfig(
    decode=RoleTarget(min_instances=1, max_instances=2, up_after=1, down_after=1, cooldown_down_s=0)
)
LAYOUT = KvLayout(
    num_layers=2, num_blocks=100, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32"
)


def join(backend: Dispatcher, instance_id: str, role: Role) -> None:
    info = PeerInfo(instance_id, role, "host", "tcp://127.0.0.1:1", "", None, LAYOUT, b"fp")
    backend.registry.register(Register(info, "tiny", 128, 1))


def report(backend: Dispatcher, instance_id: str, running: int = 0) -> None:
    backend.registry.report(LoadReport(instance_id, 0, running, 100 - running, 100))


@pytest.fixture
def make_autoscaler(tiny_model_dir):
    """``make_autoscaler(hook, (id, role)...)``: over a real, unstarted router backend."""
    made: list[Autoscaler] = []

    def make(hook: ScalingHook, *ids: tuple[str, Role]) -> Autoscaler:
        tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
        security = SocketSecurity(ClusterCredential.generate())
        settings = DispatcherSettings("tcp://127.0.0.1:1")
        backend = Dispatcher(tokenizer, "tiny", 128, settings, security)
        for instance_id, role in ids:
            join(backend, instance_id, role)
        made.append(Autoscaler(backend, hook, Policy(QUICK), AutoscalerSettings(interval_s=0.05)))
        return made[-1]

    yield make
    for scaler in made:
        asyncio.run(_shutdown(scaler))
        assert scaler.hook.closed


async def _shutdown(scaler: Autoscaler) -> None:
    await scaler.stop()
    await scaler.backend.close()


def evaluate(scaler: Autoscaler) -> ScaleDecision:
    """One evaluation while every instance reports idle (a drain waits for a fresh report)."""

    async def run() -> ScaleDecision:
        task = asyncio.create_task(scaler.run_once())
        while not task.done():
            for inst in scaler.backend.registry.instances():
                report(scaler.backend, inst.instance_id)
            await asyncio.sleep(0.05)
        return task.result()

    return asyncio.run(run())


CLUSTER_1P2D = (("p0", Role.PREFILL), ("d0", Role.DECODE), ("decode-as0", Role.DECODE))


def test_scale_down_waits_until_the_drained_instance_is_idle(make_autoscaler):
    hook = RecordingHook()
    scaler = make_autoscaler(hook, *CLUSTER_1P2D)
    backend = scaler.backend
    report(backend, "decode-as0", running=1)

    async def scenario() -> None:
        task = asyncio.create_task(scaler.run_once())
        await asyncio.sleep(0.5)
        assert backend.registry.get("decode-as0").draining  # no new request goes there
        assert hook.applied == [] and scaler.state()["recent_decisions"][0]["status"] == "draining"
        while not task.done():  # its last request finished: idle reports from now on
            report(backend, "decode-as0")
            await asyncio.sleep(0.05)
        decision = task.result()
        assert hook.applied == [decision] and decision.drain == ("decode-as0",)
        assert decision.reasons == (
            "decode 2->1: TPOT attainment unknown (0 requests); on 1: queue 0.0/instance"
            " <= 1.2, KV 1% <= 26%; draining decode-as0",
        )

    asyncio.run(scenario())
    assert scaler.state()["recent_decisions"][0]["status"] == "applied"


def test_no_decision_before_the_cluster_came_up_and_none_while_disabled(make_autoscaler):
    hook = RecordingHook()
    scaler = make_autoscaler(hook, ("p0", Role.PREFILL))
    first = evaluate(scaler)
    assert first.reasons[-1] == "decode: waiting for the cluster to come up (0 of 1 joined)"
    join(scaler.backend, "d0", Role.DECODE)
    join(scaler.backend, "d1-as0", Role.DECODE)
    join(scaler.backend, "d2-as1", Role.DECODE)  # above max 2
    scaler.update({"enabled": False})
    assert evaluate(scaler).reasons[-1] == "decode: autoscaling disabled"
    scaler.update({"enabled": True})
    assert evaluate(scaler).drain == ("d1-as0",)  # as idle and as new as d2-as1: the first
    assert [d.decode for d in hook.applied] == [2]


def test_a_forced_count_waits_for_the_instances_it_added_to_join(make_autoscaler):
    """A forced count is applied once: while the instance it added is still starting (a slow
    start on a loaded host), evaluations hold the role rather than compare the count with
    the instances registered so far and add another."""
    hook = RecordingHook()
    scaler = make_autoscaler(hook, ("p0", Role.PREFILL), ("d0", Role.DECODE))
    scaler.update({"enabled": False, "force": {"decode": 2}})
    first = evaluate(scaler)
    assert first.decode == 2 and first.forced
    assert first.reasons == ("decode 1->2: forced by the operator",)
    for _ in range(3):  # decode-as0 has not registered yet
        held = evaluate(scaler)
        assert not held.is_change and held.decode == 1
        assert "decode: waiting for 1 instance(s) to join" in held.reasons
    assert [d.decode for d in hook.applied] == [2]
    join(scaler.backend, "decode-as0", Role.DECODE)
    joined = evaluate(scaler)
    assert not joined.is_change and "decode: held at 2 by the operator" in joined.reasons
    assert [d.decode for d in hook.applied] == [2]


class PlatformPicksHook(ScalingHook):
    """Like compose or Kubernetes: gets counts only and removes a replica of its choosing,
    here always one the autoscaler did not drain."""

    name = "platform"

    def __init__(self, backend: Dispatcher) -> None:
        self.backend = backend
        self.removed: list[str] = []
        self.closed = False

    def apply(self, decision: ScaleDecision) -> None:
        decodes = [i.instance_id for i in self.backend.registry.instances(Role.DECODE)]
        for victim in [d for d in decodes if d not in decision.drain][
            : len(decodes) - decision.decode
        ]:
            self.removed.append(victim)
            self.backend.registry.remove(victim)  # as the router does once it stops reporting

    def close(self) -> None:
        self.closed = True


def test_a_drained_instance_the_platform_kept_is_undrained(make_autoscaler):
    scaler = make_autoscaler(RecordingHook(), ("p0", Role.PREFILL), ("d0", Role.DECODE))
    join(scaler.backend, "d1", Role.DECODE)
    scaler.hook = hook = PlatformPicksHook(scaler.backend)
    decision = evaluate(scaler)
    (drained,) = decision.drain
    assert decision.decode == 1 and drained in ("d0", "d1")
    assert hook.removed == [{"d0": "d1", "d1": "d0"}[drained]]  # the platform chose the other
    assert scaler.state()["current"]["decode"]["draining"] == [drained]
    evaluate(scaler)  # the registry is down to one: settled
    kept = scaler.backend.registry.get(drained)
    assert kept is not None and not kept.draining
    state = scaler.state()
    assert state["current"]["decode"]["draining"] == [] and state["settling"] == {}
    assert state["current"]["decode"]["instances"] == [drained]
    assert scaler.backend.registry.place() is not None  # d1 takes requests again
    assert state["errors"] == []


def test_a_failing_hook_is_recorded(make_autoscaler):
    hook = RecordingHook(error="platform says no")
    scaler = make_autoscaler(hook, ("p0", Role.PREFILL), ("d0", Role.DECODE))
    scaler.update({"force": {"decode": 2}})
    evaluate(scaler)
    state = scaler.state()
    assert state["recent_decisions"][0]["status"] == "failed"
    assert state["recent_decisions"][0]["error"] == "platform says no"
    assert [e["message"] for e in state["errors"]] == ["recording hook: platform says no"]
    assert state["hook"] == {"name": "recording", "applied": 0}


def test_updates_are_validated_all_or_nothing(make_autoscaler):
    scaler = make_autoscaler(RecordingHook(), *CLUSTER_1P2D)
    for body, param in (
        ({"min": {"decode": 3}}, "min.decode"),
        ({"max": {"decode": 1}, "force": {"decode": 2}}, "force.decode"),
        ({"force": {"decode": -1}}, "force.decode"),
        ({"force": {"decode": True}}, "force.decode"),
        ({"force": [1]}, "force"),
        ({"enabled": 1}, "enabled"),
    ):
        with pytest.raises(UpdateError) as e:
            scaler.update(body)
        assert e.value.param == param, body
    state = scaler.state()
    assert (state["enabled"], state["forced"], state["targets"]["decode"]["max_instances"]) == (
        True,
        {},
        2,
    )
    state = scaler.update({"min": {"decode": 2}, "max": {"prefill": 3}, "force": {"prefill": 2}})
    assert (state["targets"]["decode"]["min_instances"], state["forced"]) == (2, {"prefill": 2})
    assert state["current"]["decode"]["instances"] == ["d0", "decode-as0"]
