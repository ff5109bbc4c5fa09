"""`poller epp`'s settings: flags, POLLER_* variables and the TOML file's [epp], with
the same one-line errors and exit status as `poller run` (nothing is started)."""

from __future__ import annotations

from pathlib import Path

from tests.support.procs import poller_cli


def test_bad_flags_are_one_line_each_and_exit_2() -> None:
    done = poller_cli("epp", "--grpc-port", "abc", "--fallbacks", "-1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "Error: epp.grpc_port: should be a valid integer, unable to parse string as an "
        "integer, got 'abc' (from --grpc-port)",
        "Error: epp.fallbacks: should be at least 0, got -1 (from --fallbacks)",
    ]


def test_variables_and_the_file_are_read_and_checked_together(tmp_path: Path) -> None:
    config = tmp_path / "poller.toml"
    config.write_text('[epp]\ntls_cert_file = "cert.pem"\n')
    done = poller_cli("epp", "--config", str(config), env={"POLLER_EPP__RETRY_AFTER_SZ": "2"})
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert any("tls_cert_file and tls_key_file go together" in line for line in lines)
    assert "did you mean POLLER_EPP__RETRY_AFTER_S?" in done.stderr
    done = poller_cli("epp", env={"POLLER_METRICS_PORT": "9002"})
    assert done.returncode == 2
    assert "metrics_port and grpc_port are both 9002: give each its own" in done.stderr


def test_the_help_names_the_reference_picker_s_ports() -> None:
    done = poller_cli("epp", "--help")
    assert done.returncode == 0
    for text in ("POLLER_GRPC_PORT", "9002", "POLLER_GRPC_HEALTH_PORT", "9003", "9090"):
        assert text in done.stdout
