"""Each role's options, declared once (`palatine.config.roles`): the flags of its
subcommand, the keywords of `local_mesh`, `LocalJob` and `SlurmJob`, and the handoff to
the child come from the one declaration."""

from __future__ import annotations

import argparse
import contextlib
import io

import msgspec
import pytest

from palatine.cli import controller as controller_cli
from palatine.cli import host as host_cli
from palatine.cli import main
from palatine.cli import system as system_cli
from palatine.cli.serving import HostCommand, SystemCommand
from palatine.config import roles
from palatine.config.roles import ControllerOptions, HostOptions, LocalOptions, SystemOptions
from palatine.job.local import LocalJob
from palatine.job.slurm import SlurmJob
from palatine.tensor.client.local import local_mesh, mesh_options
from palatine.tensor.controller.startup import ControllerCommand

ROLES = [
    ("system", system_cli, SystemOptions),
    ("host", host_cli, HostOptions),
    ("controller", controller_cli, ControllerOptions),
]


def parser_of(module: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    module.add_arguments(p)  # type: ignore[attr-defined]
    return p


def help_of(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return out.getvalue()


@pytest.mark.parametrize(("command", "module", "kind"), ROLES)
def test_every_option_of_a_role_is_a_flag_of_its_subcommand_with_its_help(
    command: str, module: object, kind: type[msgspec.Struct]
) -> None:
    text = " ".join(help_of(command).split())
    actions = {a.dest: a for a in parser_of(module)._actions}
    for f in roles.option_fields(kind):
        assert roles.flag(f.wire) in text
        assert " ".join(f.help.split()) in text
        action = actions[f.name]
        assert action.option_strings == [roles.flag(f.wire)]
        assert action.default == f.default


def test_seconds_flags_keep_their_in_sec_names() -> None:
    flags = [roles.flag(f.wire) for f in roles.option_fields(ControllerOptions)]
    assert "--supervision-query-interval-in-sec" in flags
    assert "--operation-timeout-in-sec" in flags
    assert [f.name for f in roles.option_fields(ControllerOptions)][:4] == [
        "supervision_query_interval_s",
        "supervision_update_interval_s",
        "worker_progress_check_interval_s",
        "operation_timeout_s",
    ]


@pytest.mark.parametrize(
    ("module", "opts"),
    [
        (system_cli, SystemOptions(supervision_update_timeout_s=3.5, metrics_addr="127.0.0.1:0")),
        (system_cli, SystemOptions()),
        (host_cli, HostOptions(supervision_update_interval_s=0.25)),
        (host_cli, HostOptions()),
        (
            controller_cli,
            ControllerOptions(
                supervision_query_interval_s=0.5,
                supervision_update_interval_s=0.1,
                worker_progress_check_interval_s=0.3,
                operation_timeout_s=1e-3,
                operations_per_worker_progress_request=7,
                fail_on_worker_timeout=True,
            ),
        ),
        (controller_cli, ControllerOptions()),
    ],
)
def test_options_round_trip_through_the_childs_command_line(
    module: object, opts: msgspec.Struct
) -> None:
    wiring = {
        system_cli: ["--system-addr", "unix:@s"],
        host_cli: ["--system-addr", "unix:@s", "--host-world", "hostw", "--host-rank", "0"],
        controller_cli: ["--system-addr", "unix:@s", "--worker-world", "w", "--world-size", "2"],
    }[module]
    args = parser_of(module).parse_args([*wiring, *roles.to_argv(opts)])
    assert roles.from_args(type(opts), args) == opts


def test_a_role_command_is_its_options_and_its_wiring_from_one_command_line() -> None:
    args = parser_of(host_cli).parse_args(
        ["--system-addr", "unix:@s", "--host-world", "hostw", "--host-rank", "2"]
        + ["--supervision-update-interval-in-sec", "0.5"]
    )
    assert roles.from_args(HostCommand, args) == HostCommand(
        system_addr="unix:@s", host_world="hostw", host_rank=2, supervision_update_interval_s=0.5
    )
    args = parser_of(controller_cli).parse_args(
        ["--system-addr", "unix:@s", "--worker-world", "w", "--world-size", "2"]
        + ["--operation-timeout-in-sec", "9", "--extra-proc-labels", "k=v"]
    )
    cmd = roles.from_args(ControllerCommand, args)
    assert (cmd.operation_timeout_s, cmd.world_size, cmd.extra_proc_labels) == (9, 2, [("k", "v")])


def test_the_serve_protocol_keeps_the_in_sec_field_names() -> None:
    cmd = ControllerCommand(worker_world="w", system_addr="unix:@s", world_size=2)
    wire = msgspec.json.decode(msgspec.json.encode(cmd))
    assert wire["operation_timeout_in_sec"] == 120
    assert "operation_timeout_s" not in wire
    system = msgspec.convert(
        {"system_addr": "unix:", "world_eviction_timeout_in_sec": 3}, SystemCommand
    )
    assert system.world_eviction_timeout_s == 3


def test_a_mistyped_local_mesh_key_is_a_type_error_naming_it_and_the_allowed_keys() -> None:
    with pytest.raises(TypeError) as info:
        local_mesh(1, 1, operation_timout_s=5)  # (checked before anything starts)
    text = str(info.value)
    assert "local_mesh() got an unexpected keyword argument 'operation_timout_s'" in text
    assert "did you mean 'operation_timeout_s'?" in text
    for name in ("device", "operation_timeout_s", "startup_timeout_s", "metrics_addr"):
        assert name in text


def test_an_unknown_key_with_no_close_match_still_lists_the_allowed_keys() -> None:
    with pytest.raises(TypeError, match=r"'colour'\. Allowed: dashboard, dashboard_addr, device, "):
        mesh_options("local_mesh", {"colour": "blue"})


def test_local_job_and_slurm_job_check_their_keys_when_built() -> None:
    with pytest.raises(TypeError, match=r"LocalJob\(\) .* 'fail_on_worker_timout'.*did you mean"):
        LocalJob(1, 1, fail_on_worker_timout=True)
    with pytest.raises(TypeError, match=r"SlurmJob\(\) .* 'partiton'; did you mean 'partition'"):
        SlurmJob(1, 1, partiton="gpu")
    with pytest.raises(TypeError, match=r"SlurmJob\(\) .* 'device'"):
        SlurmJob(1, 1, device="cpu")  # (a local mesh's own option)
    job = SlurmJob(1, 1, operation_timeout_s=30, supervision_update_interval_s=0.5)
    assert job.controller_options.operation_timeout_s == 30
    assert job.controller_options.supervision_update_interval_s == 0.5
    assert job.host_options.supervision_update_interval_s == 0.5


def test_an_in_sec_alias_maps_to_the_s_field() -> None:
    opts = mesh_options(
        "local_mesh",
        {
            "operation_timeout_in_sec": 60,
            "startup_timeout_in_sec": 30,
            "fail_on_worker_timeout": True,
        },
    )
    assert opts.controller.operation_timeout_s == 60.0
    assert opts.controller.fail_on_worker_timeout is True
    assert opts.local.startup_timeout_s == 30.0
    assert mesh_options("local_mesh", {"operation_timeout_s": 60}) == opts._replace(
        controller=ControllerOptions(operation_timeout_s=60), local=LocalOptions()
    )


def test_both_spellings_of_one_option_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="'operation_timeout_s' and 'operation_timeout_in_sec'"):
        mesh_options("local_mesh", {"operation_timeout_s": 1, "operation_timeout_in_sec": 2})


def test_a_shared_key_goes_to_every_role_that_declares_it() -> None:
    opts = mesh_options("local_mesh", {"supervision_update_interval_s": 0.5})
    assert opts.host.supervision_update_interval_s == 0.5
    assert opts.controller.supervision_update_interval_s == 0.5


def test_option_values_keep_their_types_and_bounds() -> None:
    with pytest.raises(TypeError, match="'operation_timeout_s' must be float, not str"):
        mesh_options("local_mesh", {"operation_timeout_s": "soon"})
    with pytest.raises(ValueError, match="operation_timeout_s must be > 0, got -1"):
        mesh_options("local_mesh", {"operation_timeout_s": -1})
    with pytest.raises(ValueError, match="system_restarts must be an integer >= 0"):
        mesh_options("local_mesh", {"system_restarts": -1})
    assert mesh_options("local_mesh", {"system_restarts": 0}).local.system_restarts == 0


def test_role_bounds_name_the_field_as_the_caller_spells_it() -> None:
    with pytest.raises(ValueError, match=r"^--supervision-update-interval-in-sec must be a finite"):
        roles.check(HostOptions(supervision_update_interval_s=float("inf")))
    with pytest.raises(ValueError, match=r"^Run\.Host\.supervision_update_interval_in_sec must"):
        roles.check(HostOptions(supervision_update_interval_s=0.0), lambda f: f"Run.Host.{f}")


def test_palatine_system_restarts_zero_means_a_lost_system_is_never_started_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    from types import SimpleNamespace

    from palatine import config
    from palatine.output.logs import LogSession
    from palatine.tensor.client.local import LocalCluster

    monkeypatch.setenv("PALATINE_SYSTEM_RESTARTS", "0")
    config.reload()
    try:
        cluster = LocalCluster({}, LogSession.create("mesh", str(tmp_path)))
        lost: list[str] = []
        cluster.on_system_lost = lambda text, pid, code: lost.append(text)
        cluster.system = SimpleNamespace(pid=4242)  # type: ignore[assignment]
        cluster._start_role = lambda *a, **k: pytest.fail("started again")  # type: ignore[method-assign]
        cluster._system_ended(cluster.system, 1)  # type: ignore[arg-type]
        assert cluster.restarts_left == 0
        assert len(lost) == 1 and "(pid 4242) exited with code 1" in lost[0]
        assert cluster.system_restarts == [(4242, "exited with code 1", None, 0.0)]
        cluster.console.close(0.1)
    finally:
        monkeypatch.delenv("PALATINE_SYSTEM_RESTARTS")
        config.reload()


def test_slurm_hosts_are_started_with_the_host_options_flags() -> None:
    from palatine.job.slurm import _host_command

    plain = _host_command("SLURM_NODEID", HostOptions())
    assert plain.endswith('--host-rank "$SLURM_NODEID"')
    line = _host_command("SLURM_NODEID", HostOptions(supervision_update_interval_s=0.5))
    assert line == plain + " --supervision-update-interval-in-sec 0.5"


@pytest.mark.parametrize(
    "name",
    [
        "supervision_query_interval_s",
        "supervision_update_interval_s",
        "worker_progress_check_interval_s",
    ],
)
def test_a_controller_interval_may_be_inf(name: str) -> None:
    opts = ControllerOptions(**{name: float("inf")})
    roles.check(opts)  # (inf: never, e.g. no progress probes)
    if name not in HostOptions.__struct_fields__:  # (a host's heartbeat stays finite)
        got = mesh_options("local_mesh", {name: float("inf")}).controller
        assert getattr(got, name) == float("inf")
    wire = next(f.wire for f in roles.option_fields(ControllerOptions) if f.name == name)
    args = parser_of(controller_cli).parse_args(
        ["--system-addr", "unix:@s", "--worker-world", "w", "--world-size", "2"]
        + [roles.flag(wire), "inf"]
    )
    assert getattr(args, name) == float("inf")
    with pytest.raises(ValueError, match="must be > 0"):
        roles.check(ControllerOptions(**{name: 0.0}))


def test_the_help_of_an_option_the_configuration_defaults_gives_the_configuration_value() -> None:
    from palatine import config

    defaults = config.Config()
    for kind in (SystemOptions, HostOptions, LocalOptions):
        for f in roles.option_fields(kind):
            value = getattr(defaults, f.name, None)
            if f.default is None and value is not None:
                assert roles.help_text(f) == (
                    f"{f.help} (default {value:g}, or {config.env_var(f.name)})"
                )
    text = " ".join(help_of("system").split())
    assert f"(default {defaults.supervision_update_timeout_s:g}, or " in text
    text = " ".join(help_of("host").split())
    assert f"(default {defaults.supervision_update_interval_s:g}, or " in text


def test_the_demo_takes_the_controllers_flags_as_it_declares_them() -> None:
    from palatine.cli import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    actions = {a.dest: a for a in p._actions}
    for f in roles.option_fields(ControllerOptions):
        if f.name in ("operation_timeout_s", "fail_on_worker_timeout"):
            assert actions[f.name].option_strings == [roles.flag(f.wire)]
            assert actions[f.name].default == f.default
    args = p.parse_args(["--operation-timeout-in-sec", "30", "--fail-on-worker-timeout"])
    assert (args.operation_timeout_s, args.fail_on_worker_timeout) == (30.0, True)
    with pytest.raises(ValueError, match="declares no colour"):
        roles.add_arguments(argparse.ArgumentParser(), ControllerOptions, only=["colour"])


def test_slurm_job_startup_timeout_s_and_its_older_name() -> None:
    assert SlurmJob(1, 1).startup_timeout_s == 300.0
    assert SlurmJob(1, 1, startup_timeout_s=120).startup_timeout_s == 120
    assert SlurmJob(1, 1, start_timeout_s=90).startup_timeout_s == 90  # the alias
    with pytest.raises(TypeError, match="'startup_timeout_s' and 'start_timeout_s'"):
        SlurmJob(1, 1, startup_timeout_s=1, start_timeout_s=2)
    with pytest.raises(TypeError, match="did you mean 'startup_timeout_s'"):
        SlurmJob(1, 1, startup_timout_s=5)


def test_slurm_jobs_own_parameters_are_its_signatures() -> None:
    import inspect

    from palatine.job import slurm

    params = inspect.signature(SlurmJob).parameters
    assert set(slurm._OWN_PARAMS) == {
        n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert "partition" in slurm._OWN_PARAMS and "options" not in slurm._OWN_PARAMS


def test_local_mesh_and_local_job_check_their_options_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from palatine.tensor.client import local

    calls: list[str] = []
    checked = local.mesh_options

    def counting(caller: str, options: object) -> object:
        calls.append(caller)
        return checked(caller, options)  # type: ignore[arg-type]

    class Started(Exception):
        pass

    def start(*_: object) -> None:
        raise Started

    monkeypatch.setattr(local, "mesh_options", counting)
    monkeypatch.setattr(local, "start_checked", start)
    with pytest.raises(Started):
        local.local_mesh(1, 1, operation_timeout_s=5)
    assert calls == ["local_mesh"]
    import palatine.job.local as job_local

    calls.clear()
    monkeypatch.setattr(job_local, "mesh_options", counting)
    monkeypatch.setattr(job_local, "start_checked", start)
    job = LocalJob(1, 1, operation_timeout_s=5)
    with pytest.raises(Started):
        job.apply()
    assert calls == ["LocalJob"]
