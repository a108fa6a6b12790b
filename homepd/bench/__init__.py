"""``homepd bench``: the benchmarks that print figures (a face, beside ``cli``, ``serve`` and ``tui``).

``bench engine`` (the engine against a bare llama.cpp loop) and ``bench slo`` (the SLO capacity of any
OpenAI-compatible server, measured by the client's clock with homepd's traces, the capacity search and the
SLO of advise).  ``homepd.bench.client`` is this face's one HTTP client (httpx).
"""
