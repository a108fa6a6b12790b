"""The systemd unit passes ``systemd-analyze verify`` (and its offline security review), and ``homepd serve``
refuses a non-loopback address without an API key, as the real command."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from homepd.serve.install import homepd_executable, render_unit
from homepd.osutil import die_with_parent

# systemd < 254 does not know the two back-off keys; the unit says so in a comment
OLD_SYSTEMD_WARNING = re.compile(r"Unknown key '?(RestartSteps|RestartMaxDelaySec)'? in section '?\[?Service\]?'?")


def verify(unit_text: str, tmp_path) -> list[str]:
    """``systemd-analyze verify`` of ``unit_text``: the lines it complains with, known old-version ones removed."""
    assert shutil.which("systemd-analyze"), "systemd-analyze missing: apt-get install systemd (.ci/run does)"
    path = tmp_path / "homepd.service"
    path.write_text(unit_text)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0 or lines, "verify failed without saying why"
    return [line for line in lines if not OLD_SYSTEMD_WARNING.search(line)]


def test_unit_passes_systemd_analyze_verify(tmp_path):
    assert verify(render_unit(homepd_executable()), tmp_path) == []


def test_verify_check_catches_a_bad_unit(tmp_path):
    bad = render_unit(homepd_executable()).replace("ProtectSystem=strict", "ProtectSystem=strictly")
    assert any("ProtectSystem" in line or "protect system" in line for line in verify(bad, tmp_path))


def test_unit_exposure_is_ok(tmp_path):
    path = tmp_path / "homepd.service"
    path.write_text(render_unit(homepd_executable()))
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(path)], capture_output=True,
                          text=True, timeout=60)
    if "--offline" in done.stderr and done.returncode != 0:
        pytest.fail(f"this systemd-analyze has no offline security review (needs systemd >= 250): {done.stderr}")
    level = re.search(r"Overall exposure level for homepd.service: ([0-9.]+)", done.stdout)
    assert level, done.stdout + done.stderr
    assert float(level[1]) <= 4.0, done.stdout  # systemd calls <= 4.9 "OK"


def test_non_loopback_address_without_key_refuses_to_start(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "homepd", "serve", "--backend", "fake", "--host", "0.0.0.0",
                           "--port", "1"], capture_output=True, text=True, timeout=120, env=env, preexec_fn=die_with_parent)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "refusing to listen on '0.0.0.0' without an API key" in done.stderr
    assert "HOMEPD_API_KEY" in done.stderr


def test_a_service_that_cannot_load_its_model_exits_1_saying_how_to_pull_it(tmp_path):
    """Under systemd this exit is a failure: Restart=on-failure tries again, the journal says what to do."""
    env = {"PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(tmp_path), "HOMEPD_MODELS_DIR": str(tmp_path / "empty")}
    from test_serve_harness import free_port

    done = subprocess.run([sys.executable, "-m", "homepd", "serve", "--port", str(free_port()), "--model",
                           "smollm2-135m-instruct-q4_1"], capture_output=True, text=True, timeout=120, env=env, preexec_fn=die_with_parent)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "homepd models pull smollm2-135m-instruct-q4_1" in done.stderr
