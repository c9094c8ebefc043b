"""The systemd unit and the launchd job an operator installs say what the agent needs."""

from __future__ import annotations

import grp
import os
import plistlib
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
UNIT = REPO / "systemd" / "mlxppd.service"
PLIST = REPO / "launchd" / "com.mlxpp.mlxppd.plist"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section], Key=Value (repeatable), # and ; comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"line {number} is outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"line {number} is not Key=Value: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text(encoding="utf-8"))["Service"]


def test_the_unit_is_a_notify_service_of_the_agent(service: dict[str, list[str]]) -> None:
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["ExecStart"] == ["/opt/mlxpp/bin/mlxppd agent --config-dir /etc/mlxpp"]


def test_reload_sends_sighup_to_the_agent(service: dict[str, list[str]]) -> None:
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_the_unit_restarts_on_failure_and_watches_the_event_loop(
    service: dict[str, list[str]],
) -> None:
    assert service["Restart"] == ["on-failure"]
    assert service["RestartSec"] == ["5"]
    assert service["WatchdogSec"] == ["30"]
    assert service["TimeoutStartSec"] == ["900"]
    # The stop timeout outlasts the 120 s drain.
    assert int(service["TimeoutStopSec"][0]) > 120
    assert service["KillMode"] == ["mixed"]


def test_the_unit_owns_its_directories_and_environment(service: dict[str, list[str]]) -> None:
    assert service["ConfigurationDirectory"] == ["mlxpp"]
    assert service["StateDirectory"] == ["mlxpp"]
    assert "MLXPP_MODEL_CACHE=/var/lib/mlxpp/models" in service["Environment"]
    assert "MLXPP_STATE_DIR=/var/lib/mlxpp" in service["Environment"]
    assert service["User"] == ["mlxpp"]
    assert service["Group"] == ["mlxpp"]


def test_the_unit_is_hardened(service: dict[str, list[str]]) -> None:
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["CapabilityBoundingSet"] == [""]
    assert service["UMask"] == ["0077"]
    for key in (
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "PrivateUsers",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectHostname",
        "ProtectClock",
        "RestrictNamespaces",
        "RestrictSUIDSGID",
        "LockPersonality",
        "RestrictRealtime",
        "RemoveIPC",
    ):
        assert service[key] == ["yes"], key
    assert service["ProtectProc"] == ["invisible"]
    assert service["ProcSubset"] == ["pid"]
    # Peers and HTTP clients (IP), sd_notify and the journal (Unix), getaddrinfo (netlink).
    families = service["RestrictAddressFamilies"][0].split()
    assert len(service["RestrictAddressFamilies"]) == 1
    assert sorted(families) == ["AF_INET", "AF_INET6", "AF_NETLINK", "AF_UNIX"]


def test_the_unit_filters_system_calls(service: dict[str, list[str]]) -> None:
    assert service["SystemCallArchitectures"] == ["native"]
    # An allow list, then a deny list subtracted from it: the order matters.
    assert service["SystemCallFilter"] == ["@system-service", "~@privileged @resources"]
    assert service["SystemCallErrorNumber"] == ["EPERM"]
    # ctypes callbacks and JIT-compiled kernels need W+X pages.
    assert "MemoryDenyWriteExecute" not in service


def test_the_unit_explains_how_to_size_a_memory_limit(service: dict[str, list[str]]) -> None:
    # No limit is shipped (it depends on the host's layers); commented lines show how.
    assert "MemoryMax" not in service and "MemoryHigh" not in service
    text = UNIT.read_text(encoding="utf-8")
    assert "\n#MemoryMax=" in text and "\n#MemoryHigh=" in text
    assert "kv_budget_bytes" in text


def _verifiable_copy(directory: Path) -> Path:
    """The unit as installed on this machine: this venv's mlxppd, this process's user."""
    mlxppd = Path(sys.executable).parent / "mlxppd"
    assert mlxppd.is_file(), f"{mlxppd} is missing: install the project into the venv"
    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    lines = []
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line.startswith("ExecStart="):
            line = line.replace("/opt/mlxpp/bin/mlxppd", str(mlxppd))
        elif line.startswith("User="):
            line = f"User={user}"  # the mlxpp account need not exist on a test machine
        elif line.startswith("Group="):
            line = f"Group={group}"
        lines.append(line)
    copy = directory / UNIT.name
    copy.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return copy


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd')")
    copy = _verifiable_copy(tmp_path)
    result = subprocess.run(
        [tool, "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify warns about unknown keys and bad values on stderr but still exits 0.
    complaints = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 0 and not complaints, "\n".join(complaints) or result.stdout


#: `systemd-analyze security` rated the unit 1.2 with systemd 252 (3.3 before SystemCallFilter=,
#: ProtectProc=, ProcSubset=, PrivateUsers=, PrivateMounts=, RemoveIPC= and UMask=0077); dropping
#: any of the larger ones raises it to 1.3 or more.
MAX_EXPOSURE = 1.2


def _systemd_analyze_with_offline() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd')")
    version = subprocess.run(
        [tool, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout.split()
    if len(version) < 2 or not version[1].isdigit() or int(version[1]) < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
    return tool


def test_systemd_analyze_security_rates_the_unit_low() -> None:
    tool = _systemd_analyze_with_offline()
    result = subprocess.run(
        [tool, "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    overall = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert overall is not None, result.stdout + result.stderr
    exposure = float(overall.group(1))
    weak = [line for line in result.stdout.splitlines() if line.startswith("\N{BALLOT X}")]
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n" + "\n".join(weak)


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    with PLIST.open("rb") as f:
        loaded: dict[str, Any] = plistlib.load(f)
    return loaded


def test_the_launchd_job_runs_the_agent_on_the_config_dir(job: dict[str, Any]) -> None:
    assert job["Label"] == "com.mlxpp.mlxppd"
    assert PLIST.name == job["Label"] + ".plist"
    assert job["ProgramArguments"] == [
        "/opt/mlxpp/bin/mlxppd",
        "agent",
        "--config-dir",
        "/etc/mlxpp",
    ]
    assert job["RunAtLoad"] is True


def test_the_launchd_job_restarts_crashes_but_not_a_clean_drain_exit(job: dict[str, Any]) -> None:
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ExitTimeOut"] > 120


def test_the_launchd_job_logs_and_keeps_state_in_usr_local_var(job: dict[str, Any]) -> None:
    assert job["StandardOutPath"] == "/usr/local/var/log/mlxpp/mlxppd.log"
    assert job["StandardErrorPath"] == "/usr/local/var/log/mlxpp/mlxppd.log"
    assert job["EnvironmentVariables"]["MLXPP_MODEL_CACHE"] == "/usr/local/var/mlxpp/models"
    assert job["EnvironmentVariables"]["MLXPP_STATE_DIR"] == "/usr/local/var/mlxpp"
    assert job["ProcessType"] == "Interactive"


def test_the_launchd_job_runs_as_a_dedicated_account(job: dict[str, Any]) -> None:
    # UserName/GroupName apply to a LaunchDaemon (the system domain), which this job is.
    assert job["UserName"] == "_mlxpp"
    assert job["GroupName"] == "_mlxpp"
    assert job["Umask"] == 0o077
