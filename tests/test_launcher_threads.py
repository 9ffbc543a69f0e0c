"""``kvrelay up`` splits the CPUs between the workers of a role unless ``--threads`` is given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvrelay.cli.launcher import ClusterSpec, Launcher, worker_threads


def test_worker_threads_split_the_cpus_within_a_role() -> None:
    assert worker_threads(ClusterSpec(model="m"), num_cpus=2) == 2  # 1P+1D: each may use both
    assert worker_threads(ClusterSpec(model="m"), num_cpus=8) == 8
    assert worker_threads(ClusterSpec(model="m", num_prefill=2, num_decode=1), num_cpus=8) == 4
    assert worker_threads(ClusterSpec(model="m", num_prefill=2, num_decode=3), num_cpus=2) == 1
    colocated = ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=1)
    assert worker_threads(colocated, num_cpus=2) == 2
    two = ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=2)
    assert worker_threads(two, num_cpus=8) == 4  # colocated workers are all busy at once


class RecordingLauncher(Launcher):
    """Records the worker command lines instead of starting processes."""

    def __init__(self, spec: ClusterSpec) -> None:
        super().__init__(spec)
        self.spawned: list[list[str]] = []

    def _spawn(
        self, name: str, role: str, args: list[str], control_addr: str | None = None
    ) -> None:
        self.spawned.append(args)


def threads_flag(args: Sequence[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--threads"]


def test_workers_get_the_split_unless_threads_is_given() -> None:
    launcher = RecordingLauncher(ClusterSpec(model="m"))
    launcher.add_worker("decode")
    assert threads_flag(launcher.spawned[0]) == [str(launcher.threads_per_worker)]
    launcher.add_worker("prefill", ["--threads", "3"])
    assert threads_flag(launcher.spawned[1]) == ["3"]
    given = RecordingLauncher(ClusterSpec(model="m", worker_args=("--threads", "2")))
    given.add_worker("decode")
    assert threads_flag(given.spawned[0]) == ["2"]


def test_role_threads_override_the_split_and_threads() -> None:
    """``kvrelay up --prefill-threads/--decode-threads``: a role's own count wins over
    ``--threads`` and the split; the other role keeps those; a worker's own flag wins over all."""
    spec = ClusterSpec(model="m", worker_args=("--threads", "1"), role_threads={"prefill": 2})
    launcher = RecordingLauncher(spec)
    launcher.add_worker("prefill")
    launcher.add_worker("decode")
    launcher.add_worker("prefill", ["--threads", "4"])
    kept = [threads_flag(args)[-1] for args in launcher.spawned]  # argparse keeps the last
    assert kept == ["2", "1", "4"]
    split = RecordingLauncher(ClusterSpec(model="m", role_threads={"decode": 3}))
    split.add_worker("prefill")
    split.add_worker("decode")
    assert [threads_flag(a)[-1] for a in split.spawned] == [str(split.threads_per_worker), "3"]


def test_role_threads_must_be_positive_and_of_a_role() -> None:
    import pytest

    for bad in ({"prefill": 0}, {"router": 2}):
        with pytest.raises(ValueError, match="threads of role"):
            ClusterSpec(model="m", role_threads=bad)


def test_up_takes_role_threads_for_p_d_and_refuses_them_colocated(tiny_model_dir) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvrelay", "up", "--model", str(tiny_model_dir)]
    refused = subprocess.run([*cmd, "--colocated", "1", "--prefill-threads", "2"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode != 0
    assert "--prefill-threads and --decode-threads are for P/D workers" in refused.stderr
    helped = subprocess.run([*cmd[:4], "--help"], capture_output=True, text=True, timeout=120)
    assert "--prefill-threads" in helped.stdout and "--decode-threads" in helped.stdout


def test_up_passes_role_threads_into_the_cluster_spec(tiny_model_dir, monkeypatch) -> None:
    import os

    from kvrelay.cli import launcher, main

    monkeypatch.setenv("KVRELAY_CACHE_DIR", os.environ.get("KVRELAY_CACHE_DIR", ""))
    specs: list[ClusterSpec] = []
    monkeypatch.setattr(launcher, "run_up", lambda spec, timeout: specs.append(spec) or 0)
    assert main(["up", "--model", str(tiny_model_dir), "--prefill-threads", "2"]) == 0
    assert main(["up", "--model", str(tiny_model_dir), "--decode-threads", "3"]) == 0
    assert [dict(s.role_threads) for s in specs] == [{"prefill": 2}, {"decode": 3}]


def test_workers_spin_briefly_only_when_their_threads_fit_the_cpus(monkeypatch) -> None:
    """A worker's OpenMP wait: the short spin when the cluster's workers' threads add up to
    at most the CPUs and nothing will add workers; the passive wait `kvrelay` set otherwise;
    a deployment's own choice always; the router never gets the spin."""
    import kvrelay.cli.launcher as launcher_module
    from kvrelay import envs

    monkeypatch.setattr(launcher_module, "available_cpus", lambda: 2)
    monkeypatch.setattr(envs, "passive_wait_set_here", True)
    for name in envs.OPENMP_WAIT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as `kvrelay`'s main() sets it
    colocated = Launcher(ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=1))
    assert colocated.own_cores()  # one worker of 2 threads on 2 CPUs
    env = colocated._environ("colocated")
    assert env["GOMP_SPINCOUNT"] == str(envs.OPENMP_SHORT_SPIN) and "OMP_WAIT_POLICY" not in env
    assert colocated._environ("router")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert not Launcher(ClusterSpec(model="m")).own_cores()  # 1P+1D: 2 + 2 threads on 2 CPUs
    one_each = ClusterSpec(model="m", role_threads={"prefill": 1, "decode": 1})
    assert Launcher(one_each).own_cores()
    assert not Launcher(ClusterSpec(model="m", worker_args=("--threads", "2"))).own_cores()
    grows = ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=1, autoscale=True)
    assert not Launcher(grows).own_cores()
    shared = Launcher(ClusterSpec(model="m"))._environ("decode")
    assert shared["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in shared
    monkeypatch.setattr(envs, "passive_wait_set_here", False)  # the deployment set PASSIVE
    assert colocated._environ("colocated")["OMP_WAIT_POLICY"] == "PASSIVE"


def nice_flag(args: Sequence[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--cpu-nice"]


def test_decode_workers_yield_the_cores_they_share_with_prefill(monkeypatch) -> None:
    """``--cpu-nice 19`` for a decode worker whose cores a prefill worker may share (the
    threads overlap, or an autoscaler adds workers); none where each has its own cores, for
    prefill workers, or where the deployment chose its own."""
    import kvrelay.cli.launcher as launcher_module
    from kvrelay.worker import cpu_priority

    monkeypatch.setattr(launcher_module, "available_cpus", lambda: 2)
    shared = RecordingLauncher(ClusterSpec(model="m"))  # 1P+1D, 2 threads each on 2 CPUs
    shared.add_worker("prefill")
    shared.add_worker("decode")
    assert [nice_flag(a) for a in shared.spawned] == [[], [str(cpu_priority.DECODE_NICE)]]
    own = RecordingLauncher(ClusterSpec(model="m", role_threads={"prefill": 1, "decode": 1}))
    own.add_worker("decode")
    assert nice_flag(own.spawned[0]) == []
    one_each = {"prefill": 1, "decode": 1}
    grows = RecordingLauncher(ClusterSpec(model="m", role_threads=one_each, autoscale=True))
    grows.add_worker("decode")
    assert nice_flag(grows.spawned[0]) == ["19"]
    chosen = RecordingLauncher(ClusterSpec(model="m", worker_args=("--cpu-nice", "5")))
    chosen.add_worker("decode")
    assert nice_flag(chosen.spawned[0]) == ["5"]


_REPORT = (
    "import os, sys; from kvrelay.worker import cpu_priority as c; "
    "c.lower_cpu_priority(int(sys.argv[1])); print(os.getpriority(os.PRIO_PROCESS, 0)); "
    "print(c.autogroup_nice())"
)


def test_cpu_nice_lowers_the_process_and_its_own_session_only(tmp_path) -> None:
    """A session leader lowers its thread and its autogroup; a process in its caller's
    session lowers only itself; a value out of 0-19 is refused."""
    import os
    import subprocess
    import sys

    import pytest

    from kvrelay.worker.cpu_priority import autogroup_nice, lower_cpu_priority

    if not os.path.exists("/proc/self/autogroup"):
        pytest.skip("this kernel has no autogroup scheduling")
    # None where this process is in the root group (CI runs under PID 1's session): a member
    # of it must leave it as it is, as a member of a shell's own group must
    base = autogroup_nice()
    run = [sys.executable, "-c", _REPORT]
    leader = subprocess.run([*run, "7"], capture_output=True, text=True, start_new_session=True)
    assert leader.returncode == 0, leader.stderr
    assert leader.stdout.split() == [str(os.getpriority(os.PRIO_PROCESS, 0) + 7), "7"]
    member = subprocess.run([*run, "7"], capture_output=True, text=True)
    assert member.returncode == 0, member.stderr
    assert member.stdout.split() == [str(os.getpriority(os.PRIO_PROCESS, 0) + 7), str(base)]
    assert autogroup_nice() == base
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="--cpu-nice must be 0-19"):
            lower_cpu_priority(bad)
    assert lower_cpu_priority(0) == []


_FOLLOW = (
    "import os, sys, time; from kvrelay.worker import cpu_priority as c\n"
    "def until(has_prompt, want):\n"
    "    raised = False\n"
    "    for _ in range(100):  # one change per 100 ms without CAP_SYS_ADMIN\n"
    "        raised |= c.follow_prompts(lambda: has_prompt)\n"
    "        if c.autogroup_nice() == want:\n"
    "            return [c.autogroup_nice(), raised]\n"
    "        time.sleep(0.02)\n"
    "    return [c.autogroup_nice(), raised]\n"
    "c.lower_cpu_priority(int(sys.argv[1]))\n"
    "low = c.autogroup_nice()\n"
    "print(low, *until(True, 0), os.getpriority(os.PRIO_PROCESS, 0), *until(False, low))"
)


def test_a_lowered_worker_computes_its_own_prompts_at_nice_0(tmp_path) -> None:
    """``follow_prompts``: a session leader lowered to 19 moves its autogroup to 0 while it
    has a prompt and back to 19 after (its threads stay at 19: raising them needs a
    privilege); a process that lowered no autogroup changes nothing."""
    import os
    import subprocess
    import sys

    import pytest

    from kvrelay.worker.cpu_priority import autogroup_nice

    if not os.path.exists("/proc/self/autogroup"):
        pytest.skip("this kernel has no autogroup scheduling")
    run = [sys.executable, "-c", _FOLLOW, "19"]
    leader = subprocess.run(run, capture_output=True, text=True, start_new_session=True)
    assert leader.returncode == 0, leader.stderr
    thread_nice = str(os.getpriority(os.PRIO_PROCESS, 0) + 19)
    assert leader.stdout.split() == ["19", "0", "True", thread_nice, "19", "False"]
    member = subprocess.run(run, capture_output=True, text=True)  # this session's group
    assert member.returncode == 0, member.stderr
    base = str(autogroup_nice())
    assert member.stdout.split() == [base, base, "False", thread_nice, base, "False"]


def test_a_real_1p1d_on_shared_cores_runs_its_decode_worker_at_lower_priority(
    tiny_model_dir, tmp_path
) -> None:
    """``kvrelay up``'s processes themselves: the decode worker's threads (the OpenMP team
    among them) at nice 19 and its autogroup too; the prefill worker's and the router's as
    they were started."""
    import os

    from kvrelay.cli.launcher import available_cpus
    from kvrelay.worker.cpu_priority import autogroup_nice
    from tests.cluster_harness import running_cluster

    def nices(pid: int) -> tuple[set[int], int | None]:
        threads = {
            int(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])
            for tid in os.listdir(f"/proc/{pid}/task")
        }
        return threads, autogroup_nice(pid)

    base = os.getpriority(os.PRIO_PROCESS, 0)
    threads = str(available_cpus())  # each worker may use every CPU: they overlap
    worker_args = ("--num-blocks", "512", "--threads", threads)
    with running_cluster(tiny_model_dir, tmp_path, worker_args=worker_args) as launcher:
        import openai

        c = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        c.completions.create(model="tiny", prompt="hello " * 20, max_tokens=4)  # teams started
        by_role = {p.role: nices(p.popen.pid) for p in launcher.procs.values()}
        # the router knows which one yields its cores (it waits longer for its heartbeats)
        told = {i["role"]: i["cpu_nice"] for i in launcher.get_json("/admin/instances")["data"]}
        assert told == {"prefill": 0, "decode": 19}
    decode_threads, decode_group = by_role["decode"]
    assert decode_threads == {base + 19} and decode_group in (None, 19)
    for role in ("prefill", "router"):
        role_threads, group = by_role[role]
        assert base + 19 not in role_threads and group in (None, 0), (role, by_role[role])


def test_a_lowered_worker_may_stay_silent_longer_before_it_is_dead() -> None:
    """A worker that yields its cores (``Register.cpu_nice``) has heartbeats as low as the
    rest of it: the router gives it LOWERED_SILENCE_FACTOR x --dead-after, the others
    --dead-after; a crashed lowered worker is still reaped, later."""
    from kvrelay.protocol.messages import KvLayout, PeerInfo, Register, Role
    from kvrelay.router.registry import LOWERED_SILENCE_FACTOR, Registry

    layout = KvLayout(2, 64, 16, 2, 8, "float32")
    registry = Registry(dead_after=2.0)
    for instance_id, role, nice in (("p0", Role.PREFILL, 0), ("d0", Role.DECODE, 19)):
        info = PeerInfo(instance_id, role, "A", "tcp://x:1", "", None, layout, b"f")
        registry.register(
            Register(info, "tiny", 4096, 1, cpu_nice=nice), b"c" + nice.to_bytes(), 0.0
        )
    assert registry.get("d0").cpu_nice == 19
    assert [i.instance_id for i in registry.reap(now=2.1)] == ["p0"]
    limit = 2.0 * LOWERED_SILENCE_FACTOR
    assert LOWERED_SILENCE_FACTOR > 1 and registry.reap(now=limit - 0.1) == []
    assert [i.instance_id for i in registry.reap(now=limit + 0.1)] == ["d0"]
    # a nice out of range (a worker's word) is held to what the kernel allows
    info = PeerInfo("d1", Role.DECODE, "A", "tcp://x:2", "", None, layout, b"f")
    registry.register(Register(info, "tiny", 4096, 1, cpu_nice=1000), b"c2", 0.0)
    assert registry.get("d1").cpu_nice == 19
