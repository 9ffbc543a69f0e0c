"""The environment-variable table: types, precedence, errors, and the README's copy."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay import envs
from kvrelay.cli import build_parser, parse_args

ROOT = Path(__file__).resolve().parent.parent
WORKER = ["serve", "--role", "decode"]
REQUIRED = {"KVRELAY_MODEL": "/m", "KVRELAY_CONTROL_ADDR": "tcp://r:5557"}


def test_defaults_when_neither_flag_nor_variable_is_set() -> None:
    args = parse_args(WORKER, environ=REQUIRED)
    assert (args.model, args.control_addr) == ("/m", "tcp://r:5557")
    assert (args.host, args.port, args.status_port, args.peer_port) == ("127.0.0.1", 8000, 0, 0)
    assert (args.cluster_id, args.instance_id, args.transport) == ("default", "", "auto")
    assert (args.kv_cache_memory, args.admin_token, args.log_level) == (1.0, None, "info")


def test_flag_beats_variable_beats_default() -> None:
    environ = {**REQUIRED, "KVRELAY_STATUS_PORT": "8001", "KVRELAY_KV_CACHE_GIB": "0.5"}
    args = parse_args([*WORKER, "--status-port", "9"], environ=environ)
    assert (args.status_port, args.kv_cache_memory, args.peer_port) == (9, 0.5, 0)
    args = parse_args(
        ["--log-level", "error", *WORKER], environ={**REQUIRED, "KVRELAY_LOG_LEVEL": "debug"}
    )
    assert args.log_level == "error"


def test_empty_variable_counts_as_unset() -> None:
    args = parse_args(WORKER, environ={**REQUIRED, "KVRELAY_ADMIN_TOKEN": "", "KVRELAY_PORT": ""})
    assert (args.admin_token, args.port) == (None, 8000)


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("KVRELAY_PORT", "eighty", "KVRELAY_PORT='eighty': expected an integer"),
        ("KVRELAY_KV_CACHE_GIB", "1GiB", "KVRELAY_KV_CACHE_GIB='1GiB': expected a number"),
        ("KVRELAY_STATUS_PORT", "-1", "KVRELAY_STATUS_PORT='-1': expected a value >= 0"),
        ("KVRELAY_TRANSPORT", "rdma", "expected one of auto, shm, tcp, cuda_ipc"),
        ("KVRELAY_LOG_LEVEL", "loud", "expected one of debug, info, warning, error"),
    ],
)
def test_bad_value_is_an_error_naming_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(envs.EnvError, match=re.escape(message)):
        envs.get(name, {name: value})


def test_a_bad_variable_stops_the_command_with_exit_2() -> None:
    env = {**os.environ, **REQUIRED, "KVRELAY_PEER_PORT": "x"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", *WORKER], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "KVRELAY_PEER_PORT='x': expected an integer" in proc.stderr


def test_required_option_missing_everywhere_names_flag_and_variable(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(WORKER, environ={"KVRELAY_CONTROL_ADDR": "tcp://r:5557"})
    assert e.value.code == 2
    assert "--model is required (or set KVRELAY_MODEL)" in capsys.readouterr().err


def test_variables_apply_only_to_their_commands() -> None:
    args = parse_args(["generate", "--model", "/g"], environ={"KVRELAY_KV_CACHE_GIB": "x"})
    assert args.kv_cache_memory == 1.0  # generate's own option, not the serve variable


def test_every_variable_names_an_option_the_parser_has() -> None:
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    for var in envs.ENV_VARS:
        assert var.name.startswith("KVRELAY_") and var.help
        for command in var.commands:
            parsers = [subparsers[command]]  # and its own subcommands (kvrelay model get)
            for action in subparsers[command]._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers += list(action.choices.values())
            actions = [a for p in parsers for a in p._actions]
            if not var.flag:  # read directly (a secret is never a flag): its help names it
                assert any(var.name in (a.help or "") for a in actions), (var.name, command)
                continue
            flags = {f for a in actions for f in a.option_strings}
            assert var.flag in flags, (var.name, command)
        if not var.commands:
            assert var.flag in {f for a in parser._actions for f in a.option_strings}


def test_serve_help_states_the_precedence_and_the_variables() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", "serve", "--help"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    text = " ".join(proc.stdout.split())
    assert "flag > environment variable > default" in text
    for var in envs.ENV_VARS:
        if "serve" in var.commands:
            assert f"env {var.name}" in text, var.name


def test_launchers_do_not_pass_on_one_process_settings() -> None:
    environ = {"KVRELAY_STATUS_PORT": "8001", "KVRELAY_INSTANCE_ID": "x", "KVRELAY_MODEL": "/m"}
    assert envs.inheritable(environ) == {"KVRELAY_MODEL": "/m"}


def test_readme_lists_the_table() -> None:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- envs:begin -->\n(.*?)\n<!-- envs:end -->", text, re.S)
    assert match, "README.md has no environment-variable table"
    assert match.group(1) == envs.markdown_table(), "run: python -m kvrelay.envs"


def test_openmp_threads_wait_passively_unless_the_deployment_chose() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert envs.use_passive_openmp_wait(environ) is True
    assert environ == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    for name in envs.OPENMP_WAIT_VARS:
        chosen = {name: "ACTIVE" if name == "OMP_WAIT_POLICY" else "1000"}
        assert envs.use_passive_openmp_wait(chosen) is False
        assert chosen == {name: chosen[name]}  # left as the deployment set it


def test_kvrelay_commands_start_with_passive_openmp_wait() -> None:
    code = (
        "import os, sys; from kvrelay.cli import main; "
        "sys.argv = ['kvrelay', 'model', '--help']\n"
        "try:\n    main(['model', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in envs.OPENMP_WAIT_VARS}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "PASSIVE"


def test_up_passes_the_l2_options_on_to_its_workers() -> None:
    from kvrelay.cli.cluster import redis_worker_args

    argv = ["up", "--model", "/m", "--redis-url", "rediss://kvrelay@r:6380/0"]
    argv += ["--redis-password-file", "/s/pw", "--redis-ca-file", "/s/ca.pem"]
    argv += ["--no-l2-encrypt"]
    assert redis_worker_args(parse_args(argv, environ={})) == [
        "--redis-url", "rediss://kvrelay@r:6380/0",
        "--redis-password-file", "/s/pw",
        "--redis-ca-file", "/s/ca.pem",
        "--no-l2-encrypt",
    ]  # fmt: skip
    assert redis_worker_args(parse_args(["up", "--model", "/m"], environ={})) == []
    serve = parse_args(
        ["serve", "--role", "prefill", "--l2-encrypt"],
        environ={"KVRELAY_MODEL": "/m", "KVRELAY_CONTROL_ADDR": "tcp://r:1",
                 "KVRELAY_REDIS_PASSWORD_FILE": "/s/pw"},
    )  # fmt: skip
    assert (serve.l2_encrypt, serve.redis_password_file) == (True, "/s/pw")


def test_cache_weight_reaches_the_routers_placement(tiny_model_dir: Path) -> None:
    from kvrelay.router.server import RouterConfig, build_app

    router = ["serve", "--role", "router"]
    assert parse_args(router, environ=REQUIRED).cache_weight == 1.0
    assert (
        parse_args(router, environ={**REQUIRED, "KVRELAY_CACHE_WEIGHT": "0.5"}).cache_weight == 0.5
    )
    args = parse_args([*router, "--cache-weight", "2.5"], environ=REQUIRED)
    assert args.cache_weight == 2.5
    config = RouterConfig(
        model=str(tiny_model_dir), control_addr="tcp://127.0.0.1:1", cache_weight=0
    )
    _, dispatcher = build_app(config)
    assert dispatcher.registry.cache_weight == 0
    for bad in ("nan", "inf"):
        with pytest.raises(ValueError, match="--cache-weight must be >= 0 and finite"):
            RouterConfig(model="/m", control_addr="tcp://127.0.0.1:1", cache_weight=float(bad))


def test_short_openmp_spin_unless_the_deployment_chose() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert envs.use_short_openmp_spin(environ) is True
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": str(envs.OPENMP_SHORT_SPIN)}
    for name in envs.OPENMP_WAIT_VARS:
        chosen = {name: "PASSIVE" if name == "OMP_WAIT_POLICY" else "1000"}
        assert envs.use_short_openmp_spin(chosen) is False
        assert chosen == {name: chosen[name]}


def test_offline_engine_spins_briefly_and_commands_stay_passive() -> None:
    """Importing the engine first (an offline ``LLM``) sets the short spin while torch loads
    libgomp and removes it again (processes it starts choose their own); a ``kvrelay``
    command sets the passive wait before it imports the engine, which then keeps it."""
    env = {k: v for k, v in os.environ.items() if k not in envs.OPENMP_WAIT_VARS}
    show = "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    offline = (
        "import os, sys\nfrom kvrelay import envs\n"
        "seen = []\nreal = envs.use_short_openmp_spin\n"
        "def spy(environ=None):\n    done = real(environ)\n"
        "    seen.append(os.environ.get('GOMP_SPINCOUNT'))\n    return done\n"
        "envs.use_short_openmp_spin = spy\nimport kvrelay.engine\n"
        "assert 'torch' in sys.modules and seen == [str(envs.OPENMP_SHORT_SPIN)], seen\n"
        f"{show}"
    )
    command = (
        "import os\nfrom kvrelay.cli import main\n"
        "try:\n    main(['model', '--help'])\nexcept SystemExit:\n    pass\n"
        f"import kvrelay.engine\n{show}"
    )
    outs = []
    for code in (offline, command):
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.strip().splitlines()[-1])
    assert outs[0] == "None None"  # set for libgomp's load, then removed: not inherited
    assert outs[1] == "None PASSIVE"
