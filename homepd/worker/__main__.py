"""``python -m homepd.worker FD``: a worker process, started by the engine's process handle.

The controller passes one end of a socketpair as file descriptor ``FD`` and
sends the ``WorkerSpec`` over it first.
"""
import sys
from multiprocessing.connection import Connection

from homepd.worker.loop import worker_main

_conn = Connection(int(sys.argv[1]))
try:
    _spec = _conn.recv()
except EOFError:
    raise SystemExit(0)
worker_main(_spec, _conn)
