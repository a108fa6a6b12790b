"""The optional TOML config file: where it is found, precedence flag > HOMEPD_* > file > default, writing it."""
from __future__ import annotations

import argparse

import pytest

from homepd.config import (EngineConfig, add_config_flags, config_file_values, config_from_args, find_config_file,
                           read_config_file, write_config_file)
from homepd.errors import ConfigError



def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_no_file_means_defaults(config_home):
    assert find_config_file() is None and read_config_file() == {}
    assert parse([]) == EngineConfig()


@pytest.mark.two_cores  # its file names cores 0 and 1, checked against this box's
def test_precedence_flag_then_environment_then_file_then_default(config_home, monkeypatch):
    path = config_home / "xdg" / "homepd" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text('chunk = 64\nn_ctx = 2048\nmode = "disaggregated"\nprefill_cores = [0]\n[serve]\nport = 1\n')
    assert find_config_file() == path
    assert parse([]).chunk == 64 and parse([]).prefill_cores == (0,)
    monkeypatch.setenv("HOMEPD_CHUNK", "32")
    assert parse([]).chunk == 32 and parse([]).n_ctx == 2048
    assert parse(["--chunk", "16"]).chunk == 16
    assert parse(["--mode", "colocated"]).mode == "colocated"


def test_user_file_wins_over_system_file_and_homepd_config_over_both(config_home, monkeypatch):
    system = config_home / "etc" / "config.toml"
    system.parent.mkdir(parents=True)
    system.write_text("n_seq_max = 3\n")
    assert parse([]).n_seq_max == 3
    user = config_home / "xdg" / "homepd" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text("n_seq_max = 5\n")
    assert parse([]).n_seq_max == 5
    explicit = config_home / "mine.toml"
    explicit.write_text("n_seq_max = 7\n")
    monkeypatch.setenv("HOMEPD_CONFIG", str(explicit))
    assert parse([]).n_seq_max == 7
    monkeypatch.setenv("HOMEPD_CONFIG", str(config_home / "absent.toml"))
    with pytest.raises(ConfigError, match="absent.toml.: no such file"):
        find_config_file()


@pytest.mark.parametrize("text, match", [
    ("chunky = 3\n", "unknown key 'chunky'"),
    ("fault = 'swap_seq'\n", "unknown key 'fault'"),  # test-only fields have no flag, so no file key
    ("n_ctx = 'big'\n", "n_ctx = 'big' is not valid"),
    ("chunk = 0\n", "chunk = 0 is not valid"),
    ("n_ctx = [\n", "cannot be read"),
])
def test_bad_file_is_a_clear_error(config_home, monkeypatch, text, match):
    path = config_home / "bad.toml"
    path.write_text(text)
    monkeypatch.setenv("HOMEPD_CONFIG", str(path))
    with pytest.raises(ConfigError, match=match):
        parse([])


@pytest.mark.two_cores  # its file names cores 0 and 1, checked against this box's
def test_write_then_read_back_merges_and_keeps_tables(config_home):
    path = write_config_file({"mode": "disaggregated", "chunk": 128, "prefill_cores": (0, 1), "resume": False,
                              "serve": {"port": 9999, "host": "0.0.0.0"}})
    assert path == config_home / "xdg" / "homepd" / "config.toml"
    write_config_file({"chunk": None, "n_threads": None, "hang_timeout_s": 12.5, "model": 'a "quoted" name'})
    doc = read_config_file(path)
    assert doc["serve"] == {"port": 9999, "host": "0.0.0.0"}
    values = config_file_values(EngineConfig, None, doc)
    assert values == {"mode": "disaggregated", "chunk": None, "prefill_cores": (0, 1), "resume": False,
                      "hang_timeout_s": 12.5, "model": 'a "quoted" name'}
    assert parse([]).chunk is None  # "none" = unchunked, not the default 256


def test_write_refuses_a_value_that_would_not_read_back(config_home):
    with pytest.raises(ConfigError):
        write_config_file({"n_ctx": "lots"})
    with pytest.raises(ConfigError, match="unknown key"):
        write_config_file({"not_a_field": 1})


def test_the_extents_option_still_answers_to_its_old_slot_names(config_home, monkeypatch):
    """--extents was --slots (n_extents was n_slots): the old flag, HOMEPD_SLOTS and the file key n_slots
    still set it, the new name wins where both are given, and --help shows only the new flag."""
    assert parse(["--slots", "2"]).n_extents == 2 and parse(["--extents", "3"]).n_extents == 3
    path = config_home / "xdg" / "homepd" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text("n_slots = 5\n")
    assert parse([]).n_extents == 5
    path.write_text("n_slots = 5\nn_extents = 6\n")
    assert parse([]).n_extents == 6
    monkeypatch.setenv("HOMEPD_SLOTS", "7")
    assert parse([]).n_extents == 7
    monkeypatch.setenv("HOMEPD_EXTENTS", "8")
    assert parse([]).n_extents == 8 and parse(["--slots", "9"]).n_extents == 9
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert "--extents" in parser.format_help() and "--slots " not in parser.format_help()
    monkeypatch.setenv("HOMEPD_SLOTS", "many")
    monkeypatch.delenv("HOMEPD_EXTENTS")
    with pytest.raises(ConfigError, match="HOMEPD_SLOTS='many' is not valid"):
        parse([])


def test_writing_a_renamed_key_drops_its_old_name(config_home):
    path = config_home / "xdg" / "homepd" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text("n_slots = 5\nchunk = 64\n")
    write_config_file({"n_extents": 2})
    assert read_config_file(path) == {"chunk": 64, "n_extents": 2}
    assert config_file_values(EngineConfig, None, {"n_slots": 3}) == {"n_extents": 3}
