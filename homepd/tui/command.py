"""``homepd app`` (and ``homepd`` alone in a terminal): open the terminal app.

It attaches to a ``homepd serve`` already answering on this box (the address
and API key ``homepd serve`` reads: ``HOMEPD_HOST``/``HOMEPD_PORT``/
``HOMEPD_API_KEY`` or the config file's ``[serve]`` table), or to ``--attach
URL``; otherwise (or with ``--embedded``) it runs its own engine with the
engine flags given here, pulling a missing catalog model first.
"""
from __future__ import annotations

import argparse

from homepd.config import add_config_flags, config_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "app", help="the terminal app: dashboard, advise, chat tester, history (what `homepd` opens in a terminal)",
        description="The terminal app. Attaches to a running `homepd serve` on this box when one answers, else "
                    "runs its own engine with these flags. Keys: d/a/c/h switch screens, ? help, q quit.")
    add_config_flags(p)
    p.add_argument("--attach", metavar="URL", default=None,
                   help="attach to the homepd serve at URL (default: the local service, when one answers)")
    p.add_argument("--embedded", action="store_true", help="run an engine in the app even when a service answers")
    p.add_argument("--db", default=None, help="run database for advise and history (default: $HOMEPD_DB, else the "
                                              "XDG data dir)")
    p.set_defaults(func=run_app)


def make_source(args: argparse.Namespace):
    """The data source the flags ask for: remote when attached (or a local service answers), else embedded."""
    # why: the engine's libraries (jinja2, numpy), httpx and sqlite load for `app` only
    from homepd.tui.sources.embedded import EmbeddedSource
    from homepd.tui.sources.remote import RemoteSource, find_service, service_address

    config = config_from_args(args)
    if not args.embedded:
        host, port, api_key = service_address()
        url = args.attach or f"http://{host}:{port}"
        if args.attach or find_service(url):
            return RemoteSource(url, config, api_key=api_key, db=args.db)
    return EmbeddedSource(config, db=args.db)


def run_app(args: argparse.Namespace) -> int:
    # why: textual loads for `app` only
    from homepd.tui.app import HomepdApp

    source = make_source(args)
    app = HomepdApp(source)
    try:
        app.run()
    finally:
        source.stop()  # idempotent: also when the app ended some other way than q
    return app.return_code or 0
