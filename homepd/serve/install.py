"""``homepd service install``: the systemd unit and settings template from ``packaging/``, put in place.

The unit's ``ExecStart`` is pointed at the ``homepd`` being run, which must be
outside /home and /root (the unit's ``ProtectHome=yes`` hides them from the
service): clone into /opt/homepd, say.  An existing settings file is kept.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from homepd.errors import ConfigError

PACKAGING_DIR = Path(__file__).resolve().parents[2] / "packaging"
UNIT_NAME = "homepd.service"
ENV_NAME = "homepd.env"
HIDDEN_BY_PROTECT_HOME = ("/home/", "/root/", "/run/user/")


def homepd_executable() -> str:
    """The ``homepd`` script next to this interpreter (the venv's)."""
    return str(Path(sys.executable).with_name("homepd"))


def render_unit(executable: str, template: str | None = None) -> str:
    """The unit text with ExecStart running ``executable serve``."""
    text = template if template is not None else (PACKAGING_DIR / UNIT_NAME).read_text()
    rendered, n = re.subn(r"(?m)^ExecStart=.*$", lambda _: f"ExecStart={executable} serve", text)
    assert n == 1, "the unit template must have one ExecStart line"
    return rendered


def install_service(dry_run: bool = False, unit_dir: str = "/etc/systemd/system", config_dir: str = "/etc/homepd",
                    executable: str | None = None, out=sys.stdout, reload: bool = True) -> int:
    """Write the unit and (if absent) the settings file, reload systemd, say what to do next."""
    executable = executable or homepd_executable()
    if not (PACKAGING_DIR / UNIT_NAME).is_file():
        raise ConfigError(f"{PACKAGING_DIR / UNIT_NAME} not found: run this from a homepd source checkout")
    if executable.startswith(HIDDEN_BY_PROTECT_HOME):
        raise ConfigError(f"{executable} is under a home directory, which the service cannot see "
                          "(ProtectHome=yes): clone homepd into /opt/homepd, run `uv sync` there, then "
                          "`sudo /opt/homepd/.venv/bin/homepd service install`")
    if not dry_run and os.geteuid() != 0:
        raise ConfigError("writing to /etc needs root: sudo " + executable + " service install "
                          "(or --dry-run to see what it would do)")
    unit_path, env_path = Path(unit_dir) / UNIT_NAME, Path(config_dir) / ENV_NAME
    unit = render_unit(executable)
    say = lambda line="": print(line, file=out)  # noqa: E731
    prefix = "would " if dry_run else ""
    say(f"{prefix}write {unit_path}:")
    say("".join("    " + line + "\n" for line in unit.splitlines()))
    if env_path.exists():
        say(f"keep {env_path} (exists)")
    else:
        say(f"{prefix}write {env_path} (settings template: HOMEPD_* variables)")
    reload_command = ["systemctl", "daemon-reload"]
    say(f"{prefix}run {' '.join(reload_command)}")
    if not dry_run:
        unit_path.parent.mkdir(parents=True, exist_ok=True)
        unit_path.write_text(unit)
        if not env_path.exists():
            env_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PACKAGING_DIR / ENV_NAME, env_path)
            env_path.chmod(0o640)  # it may hold the API key
        if reload and shutil.which("systemctl"):
            subprocess.run(reload_command, check=False)
    say()
    say("next:")
    say(f"  edit {env_path} (model, address, API key)")
    say("  HOMEPD_MODELS_DIR=/var/lib/homepd/models " + executable + " models pull <model>   # the service never downloads")
    say("  systemctl enable --now homepd && journalctl -u homepd -f")
    say("  curl http://127.0.0.1:8439/ready")
    return 0
