"""The models a service serves (``homepd.config.models``): ``--model`` repeated, ``[models.NAME]`` tables with
their own engine settings, aliases, role, keep-alive and pin, and the errors that name the bad table or key."""
from __future__ import annotations

import pytest

from homepd.config import EngineConfig
from homepd.config.models import ModelRole, ModelSpec, parse_keep_alive_s, served_models
from homepd.errors import ConfigError

SMOL, GEMMA = "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"


def test_model_given_twice_serves_both_under_their_names():
    specs = served_models((SMOL, "/models/Coder-7B.Q4.gguf"), {})
    assert [(s.name, s.source, s.role) for s in specs] == [(SMOL, SMOL, ModelRole.CHAT),
                                                             ("Coder-7B.Q4", "/models/Coder-7B.Q4.gguf", ModelRole.CHAT)]


def test_a_table_gives_a_model_its_own_engine_settings_aliases_keep_alive_and_pin():
    document = {"n_ctx": 8192, "models": {
        "assist": {"model": SMOL, "aliases": ["home-assistant"], "n_ctx": 2048, "n_seq_max": 4, "pin": True},
        "chat": {"model": GEMMA, "keep_alive": "10m", "mode": "disaggregated"},
        "embed": {"model": "all-minilm-l6-v2", "role": "embedding"}}}
    specs = {s.name: s for s in served_models((), document)}
    assist, chat = specs["assist"], specs["chat"]
    assert assist.aliases == ("home-assistant",) and assist.is_pinned and assist.keep_alive_s is None
    config = assist.engine_config(EngineConfig(n_ctx=8192))
    assert (config.model, config.n_ctx, config.n_seq_max) == (SMOL, 2048, 4)
    assert chat.keep_alive_s == 600 and chat.engine_config(EngineConfig()).mode == "disaggregated"
    assert chat.engine_config(EngineConfig(n_ctx=8192)).n_ctx == 8192  # the service's own where the table is silent
    assert specs["embed"].role is ModelRole.EMBEDDING


def test_a_model_flag_naming_a_table_takes_its_settings_and_comes_first():
    document = {"models": {"other": {"model": GEMMA}, "assist": {"model": SMOL, "n_ctx": 1024}}}
    specs = served_models(("assist",), document)
    assert [s.name for s in specs] == ["assist", "other"] and dict(specs[0].overrides)["n_ctx"] == 1024
    assert served_models((SMOL,), document)[0].name == "assist"  # named by its model, too


def test_the_service_keep_alive_applies_where_a_table_is_silent():
    document = {"models": {"a": {"model": SMOL}, "b": {"model": GEMMA, "keep_alive": "-1"}}}
    specs = {s.name: s for s in served_models((), document, keep_alive_s=300.0)}
    assert specs["a"].keep_alive_s == 300.0 and specs["b"].keep_alive_s is None


def test_the_embedding_model_flag_adds_an_embedding_model():
    specs = served_models((SMOL,), {}, embedding_model="all-minilm-l6-v2")
    assert specs[-1] == ModelSpec("all-minilm-l6-v2", "all-minilm-l6-v2", ModelRole.EMBEDDING)


@pytest.mark.parametrize("document, words", [
    ({"models": {"a": {"model": SMOL, "n_ctx": "big"}}}, "[models.a]: n_ctx = 'big' is not valid"),
    ({"models": {"a": {"model": SMOL, "colour": "red"}}}, "[models.a]: unknown key 'colour'"),
    ({"models": {"a": {"model": SMOL, "role": "vision"}}}, "[models.a]: role must be chat or embedding"),
    ({"models": {"a": {"model": SMOL, "aliases": "x"}}}, "[models.a]: aliases must be a list of names"),
    ({"models": {"a": {"model": SMOL, "keep_alive": "soon"}}}, "[models.a]: not a keep-alive: 'soon'"),
    ({"models": {"a": {"model": SMOL, "pin": "yes"}}}, "[models.a]: pin must be true or false"),
    ({"models": {"a": {"model": SMOL, "aliases": ["x"]}, "b": {"model": GEMMA, "aliases": ["x"]}}},
     "two models answer to 'x': a and b"),
    ({"models": {"e": {"model": "all-minilm-l6-v2", "role": "embedding"}}}, "no chat model to serve"),
    ({"models": {"a": 3}}, "[models] holds one table per model"),
])
def test_a_bad_table_is_an_error_naming_it(document, words):
    with pytest.raises(ConfigError, match=None) as err:
        served_models((), document)
    assert words in str(err.value)


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("2h", 7200.0), ("0", 0.0),
                                           ("-1", None), ("-5m", None)])
def test_keep_alive_durations(text, seconds):
    assert parse_keep_alive_s(text) == seconds
