"""``homepd serve`` and ``homepd service install``: the service's command-line face."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from homepd.config import (EngineConfig, add_config_flags, add_option_flags, config_file_values, config_from_args,
                           env_default, kv_layout_text, read_config_file)
from homepd.config.models import MODELS_TABLE, ModelRole, served_models
from homepd.serve.settings import ServeSettings


class _Models(argparse.Action):
    """``--model`` given once or more: the first use replaces the default, later ones add a model."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = tuple(namespace.model_sources) if getattr(namespace, "_models_given", False) else ()
        namespace.model_sources = (*before, values)
        namespace._models_given = True


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings)}).validated()


def serve(args: argparse.Namespace) -> int:
    # why: the HTTP stack (fastapi, uvicorn), llama_cpp, numpy and psutil load for `serve` only
    from homepd.hw.monitor import Sampler
    from homepd.launch import config_origin
    from homepd.serve.server import run_server
    from homepd.serve.service import Service

    settings = settings_from_args(args)  # refuses a non-loopback address without a key, before loading anything
    document = read_config_file()
    sources = args.model_sources or (() if document.get(MODELS_TABLE) else (EngineConfig.model,))
    specs = served_models(sources, document, keep_alive_s=settings.keep_alive_s,
                          embedding_model=settings.embedding_model)
    default = next(s for s in specs if s.role is ModelRole.CHAT)
    config = config_from_args(args, model=default.source)
    origin = config_origin(config)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    n_chat = sum(s.role is ModelRole.CHAT for s in specs)
    what = f"{config.model}" if n_chat == 1 else f"{n_chat} models ({', '.join(s.name for s in specs)})"
    print(f"homepd: serving {what} ({config.mode}{kv_layout_text(config)}) on http://{settings.host}:{settings.port}/v1 "
          f"{'(API key required)' if settings.api_key else '(no API key)'}", file=sys.stderr)
    print(f"homepd: {origin.line}", file=sys.stderr)
    with Sampler(period_s=1.0) as sampler:
        return run_server(Service(config, settings, sampler=sampler, origin=origin, models=specs))


def install(args: argparse.Namespace) -> int:
    from homepd.serve.install import install_service  # why: `homepd --help` does not load it

    return install_service(dry_run=args.dry_run, unit_dir=args.unit_dir, config_dir=args.config_dir)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API (see docs/serve.md)",
                              description="Run the engine behind an OpenAI-compatible HTTP API.  Every flag is "
                                          "also a HOMEPD_* variable and a config-file key.  Live advice "
                                          "(--advice-*) compares the traffic with the stored advise evidence: "
                                          "GET /advice, POST /advice/apply (see docs/serve.md, Live advice).")
    add_config_flags(p, exclude=("model",))
    given = env_default("model", config_file_values(EngineConfig).get("model"))
    p.add_argument("--model", dest="model_sources", action=_Models, default=(given,) if given else (),
                   help="catalog name or local GGUF path; give it more than once to serve several models, each "
                        "loaded on demand under --memory-budget (or name them in [models.NAME] tables of the "
                        "config file: docs/serve.md, Several models)")
    add_option_flags(p, ServeSettings, section="serve")
    p.set_defaults(func=serve)

    s = subparsers.add_parser("service", help="install homepd serve as a systemd service")
    actions = s.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = actions.add_parser("install", help="write the systemd unit and the settings template, reload systemd")
    i.add_argument("--dry-run", action="store_true", help="print what would be written and run; change nothing")
    i.add_argument("--unit-dir", default="/etc/systemd/system", help=argparse.SUPPRESS)
    i.add_argument("--config-dir", default="/etc/homepd", help=argparse.SUPPRESS)
    i.set_defaults(func=install)
