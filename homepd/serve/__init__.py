"""``homepd serve``: the engine behind an OpenAI-compatible HTTP service (FastAPI + uvicorn).

The one package that imports fastapi, starlette, uvicorn, prometheus_client and
sdnotify.  ``service`` owns the engine and admission, ``generation`` turns an
engine stream into OpenAI responses, the ``*_routes`` modules are the HTTP
faces, ``server`` runs uvicorn with drain-on-SIGTERM, ``command`` adds the
``serve`` and ``service install`` commands.
"""
