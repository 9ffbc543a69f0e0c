"""``kvrelay up`` splits the CPUs between the workers it starts unless ``--threads`` is given."""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.cli.launcher import ClusterSpec, Launcher, worker_threads


def test_worker_threads_split_the_cpus() -> None:
    assert worker_threads(ClusterSpec(model="m"), num_cpus=2) == 1  # 1P+1D on 2 cores
    assert worker_threads(ClusterSpec(model="m"), num_cpus=8) == 4
    colocated = ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=1)
    assert worker_threads(colocated, num_cpus=2) == 2
    assert worker_threads(ClusterSpec(model="m", num_prefill=2, num_decode=3), num_cpus=2) == 1


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
