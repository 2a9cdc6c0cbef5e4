"""Settings: flags over environment over the config file; bad values refused with a reason."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pipeshard.cli import main
from server.settings import GatewaySettings
from stage_node.settings import StageSettings
from tests.conftest import ExportFn, make_certificates


@pytest.mark.unit
def test_gateway_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        'stages = ["10.0.0.1:50051", "10.0.0.2:50051"]\nlisten = "0.0.0.0:9000"\n'
        "step_timeout = 5.0\nmax_concurrent = 3\n"
    )
    settings = GatewaySettings.load(config)
    assert settings.stages == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert settings.listen == "0.0.0.0:9000" and settings.max_concurrent == 3

    monkeypatch.setenv("PIPESHARD_GATEWAY_STEP_TIMEOUT", "7")
    monkeypatch.setenv("PIPESHARD_GATEWAY_API_KEYS", "a,b")
    settings = GatewaySettings.load(config, listen="127.0.0.1:8001")
    assert settings.step_timeout == 7.0  # environment over file
    assert settings.listen == "127.0.0.1:8001"  # flag over both
    assert [k.get_secret_value() for k in settings.api_keys] == ["a", "b"]

    with pytest.raises(ValueError, match="does not exist"):
        GatewaySettings.load(tmp_path / "missing.toml")


@pytest.mark.unit
def test_stage_settings_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESHARD_STAGE_THREADS", "3")
    monkeypatch.setenv("PIPESHARD_STAGE_CPUS", "0,2-3")
    settings = StageSettings(shards=tmp_path, stage=1)
    assert settings.threads == 3 and settings.cpu_list() == {0, 2, 3}
    assert settings.hidden_dtype == "fp16" and settings.listen == "127.0.0.1:50051"


@pytest.mark.unit
def test_bad_settings_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--stages", "nonsense"]) == 2
    assert "stage address must be HOST:PORT" in capsys.readouterr().err
    assert main(["stage", "--shards", str(tmp_path), "--stage", "0", "--listen", "x"]) == 2
    assert "listen address must be HOST:PORT" in capsys.readouterr().err
    assert main(["serve", "--stages", "h:1", "--no-batching", "--micro-batch-groups", "2"]) == 2
    assert "do not go together" in capsys.readouterr().err
    stage = ["stage", "--shards", str(tmp_path), "--stage", "0"]
    assert main([*stage, "--state-sessions", "4", "--state-cache-size", "2"]) == 2
    assert "give state_sessions (sessions the state pool holds) or state_cache_size" in (
        capsys.readouterr().err
    )
    assert main([*stage, "--state-sessions", "9", "--max-sessions", "8"]) == 2
    assert "state_sessions (9) is more than max_sessions (8)" in capsys.readouterr().err
    for listen in ("8000", "localhost", "h:99999"):
        assert main(["serve", "--stages", "h:1", "--listen", listen]) == 2
        assert "listen address must be HOST:PORT" in capsys.readouterr().err
    # a port in use is found before the start (which would wait for the stages first)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        assert main(["serve", "--stages", "h:1", "--listen", listen, "--start-timeout", "5"]) == 2
    assert f"cannot listen on {listen}: address already in use" in capsys.readouterr().err
    # so is a stage's metrics port, before its shard is loaded (there is none here)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stage = ["stage", "--shards", str(tmp_path), "--stage", "0"]
        assert main([*stage, "--listen", "127.0.0.1:0", "--metrics-port", str(port)]) == 2
    assert f"cannot serve metrics on port {port}: address already in use" in (
        capsys.readouterr().err
    )


@pytest.mark.unit
def test_the_gateway_says_where_it_is_and_whether_it_is_open() -> None:
    """settings.url is where a client here reaches the gateway; open_to_the_network is a
    listen address beyond loopback with no API key (serve and up warn about it)."""
    cases = [
        ("127.0.0.1:8000", "http://127.0.0.1:8000", False),
        ("localhost:8000", "http://localhost:8000", False),
        ("[::1]:8000", "http://[::1]:8000", False),
        ("0.0.0.0:8000", "http://127.0.0.1:8000", True),
        ("[::]:9000", "http://[::1]:9000", True),
        ("192.168.1.20:8000", "http://192.168.1.20:8000", True),
        ("gateway.lan:8000", "http://gateway.lan:8000", True),
    ]
    for listen, url, open_ in cases:
        settings = GatewaySettings(stages=["h:1"], listen=listen)
        assert (settings.url, settings.open_to_the_network) == (url, open_), listen
        keyed = GatewaySettings(stages=["h:1"], listen=listen, api_keys=["k"])
        assert not keyed.open_to_the_network


@pytest.mark.unit
def test_no_batching_gives_every_running_request_a_group_of_its_own() -> None:
    plain = GatewaySettings(stages=["h:1", "h:2"], max_concurrent=6)
    batched = plain.ring_scheduler_config(2, paged=True)
    assert not batched.solo and batched.groups == 2
    solo = GatewaySettings(stages=["h:1", "h:2"], max_concurrent=6, batching=False)
    for paged in (True, False):
        config = solo.ring_scheduler_config(2, paged=paged)
        assert config.solo and config.lockstep and config.groups == 6 and not config.group_size
        assert config.busy_prefill_chunk == 32 and config.max_prefill_in_flight == 6


@pytest.mark.component
def test_health_probes_follow_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from server.api.app import create_app

    settings = GatewaySettings(
        stages=["h:1"], health_interval=3, health_timeout=0.25, link_loss_timeout=2.5
    )
    pipeline = create_app(settings).state.gateway.pipeline
    assert (pipeline.health_interval, pipeline.health_timeout) == (3, 0.25)
    assert pipeline.link_loss_timeout == 2.5
    assert main(["serve", "--stages", "h:1", "--health-interval", "0"]) == 2
    assert "health_interval: Input should be greater than 0" in capsys.readouterr().err
    # one probe that times out is no lost link
    assert main(["serve", "--stages", "h:1", "--link-loss-timeout", "1"]) == 2
    assert "link_loss_timeout (1) must be longer than health_timeout (1)" in (
        capsys.readouterr().err
    )


@pytest.mark.integration
def test_cpus_pins_every_thread_of_the_stage_process(tiny_export: ExportFn, tmp_path: Path) -> None:
    """`--cpus` pins the whole stage process: inference, gRPC and event-loop threads, and the
    ones a library started at import, before the stage pinned itself."""
    from tests.processes import start_stages

    procs, _ = start_stages(tiny_export("qwen2", 2), tmp_path, ["--cpus", "0"], stages=[1])
    try:
        pid = procs[0].popen.pid
        allowed = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            status = (task / "status").read_text()
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
            allowed[task.name] = line.split()[-1]
        assert len(allowed) > 3  # gRPC's threads and the inference pool too
        assert set(allowed.values()) == {"0"}, allowed
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.unit
def test_speculation_pauses_under_load_where_a_stage_shares_the_machine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """speculation_max_users "auto": 1 where a stage runs on this machine (the draft shares
    its cores), 0 (no limit) where none does or no draft model runs; a number wins."""
    import socket

    here = GatewaySettings(stages=["127.0.0.1:1", "203.0.113.9:2"])
    assert here.speculation_max_users == "auto"
    limit, why = here.speculation_limit()
    assert limit == 1 and "stage 0 (127.0.0.1:1) runs on this machine" in why
    assert here.speculation_limit(draft_model=False)[0] == 0  # prompt lookup: no model
    # this machine's own (non-loopback) address counts as here, other hosts do not
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
        route.connect(("203.0.113.9", 9))  # no packet is sent: this picks the outgoing address
        own = route.getsockname()[0]
    assert GatewaySettings(stages=["203.0.113.9:1", f"{own}:2"]).speculation_limit()[0] == 1
    away = GatewaySettings(stages=["203.0.113.9:1", "no-such-host.invalid:2"])
    assert away.speculation_limit() == (0, "auto: no stage runs on this machine")
    assert (
        GatewaySettings(stages=["127.0.0.1:1"], speculation_max_users=3).speculation_limit()[0] == 3
    )
    monkeypatch.setenv("PIPESHARD_GATEWAY_SPECULATION_MAX_USERS", "0")
    assert GatewaySettings(stages=["127.0.0.1:1"]).speculation_limit()[0] == 0
    monkeypatch.setenv("PIPESHARD_GATEWAY_SPECULATION_MAX_USERS", "auto")
    assert GatewaySettings(stages=["127.0.0.1:1"]).speculation_limit()[0] == 1
    monkeypatch.delenv("PIPESHARD_GATEWAY_SPECULATION_MAX_USERS")
    for bad in ("-1", "many"):
        assert main(["serve", "--stages", "h:1", "--speculation-max-users", bad]) == 2
        assert "speculation_max_users" in capsys.readouterr().err
        assert main(["up", "--speculation-max-users", bad]) == 2
        assert "--speculation-max-users must be auto or a number" in capsys.readouterr().err


@pytest.mark.component
def test_a_bad_tls_pair_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve and stage check their certificate and key at start: both given, files that
    exist, PEM, and a key that belongs to the certificate."""
    _, cert, key = make_certificates(tmp_path)
    _, other_cert, other_key = make_certificates(tmp_path / "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (["--tls-cert", str(cert)], "needs both tls_cert and tls_key"),
        (["--tls-cert", str(cert), "--tls-key", str(tmp_path / "no.key")], "does not exist"),
        (["--tls-cert", str(junk), "--tls-key", str(key)], "not a PEM certificate"),
        (["--tls-cert", str(cert), "--tls-key", str(other_key)], "does not belong"),
        (["--tls-cert", str(other_cert), "--tls-key", str(key)], "does not belong"),
    ]
    for flags, reason in cases:
        assert main(["serve", "--stages", "h:1", *flags]) == 2
        err = capsys.readouterr().err
        assert reason in err and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert main(["stage", "--shards", str(tmp_path), "--stage", "0", *flags]) == 2
        err = capsys.readouterr().err
        assert reason in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    settings = GatewaySettings(stages=["h:1"], tls_cert=cert, tls_key=key)
    assert settings.scheme == "https"
    assert GatewaySettings(stages=["h:1"]).scheme == "http"
