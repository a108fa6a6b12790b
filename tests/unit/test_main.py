"""The dispatcher above the faces: every command module is imported, and one that fails stops homepd."""
from __future__ import annotations

import pytest

import homepd.main as homepd_main


@pytest.fixture
def broken_faces(tmp_path, monkeypatch):
    """Two command modules on the path: one whose own import fails inside it, one that is missing."""
    (tmp_path / "homepd_face_broken.py").write_text("import homepd_no_such_library\n\ndef register(sub): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name,cause", [("homepd_face_broken", "homepd_no_such_library"),
                                        ("homepd_face_missing", "homepd_face_missing")])
def test_a_face_that_fails_to_import_stops_homepd_naming_it(broken_faces, monkeypatch, name, cause):
    monkeypatch.setattr(homepd_main, "COMMAND_MODULES", (*homepd_main.COMMAND_MODULES, name))
    with pytest.raises(homepd_main.FaceImportError, match=rf"command module {name} failed to import .*{cause}"):
        homepd_main.main(["--help"])


def test_every_shipped_face_registers_its_commands():
    commands = homepd_main.build_parser()._subparsers._group_actions[0].choices
    assert {"app", "serve", "advise", "run", "bench", "trace", "probe", "models", "history"} <= set(commands)
