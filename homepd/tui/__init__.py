"""The terminal app (``homepd`` in a terminal, ``homepd app``): dashboard, advise, chat tester, history.

The only package that imports ``textual``.  It reads the engine, the sampler,
the store and a running ``homepd serve`` through a ``DataSource``
(``homepd.tui.sources``): blocking calls made from Textual thread workers,
whose results come back as messages (``homepd.tui.messages``) carrying the
frozen view records of ``homepd.tui.records``.  Screens show one task each;
widgets get data pushed in; layout and colour live in ``homepd.tcss``.
"""
