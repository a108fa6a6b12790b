"""``python -m homepd.worker FD``: a worker process, started by the engine's process handle.

The controller passes one end of a socketpair as file descriptor ``FD`` and
sends the ``WorkerSpec`` over it first.  A worker whose code is not its
controller's (the package was upgraded in place under a running service, and
this is a restart) says so in a ``WorkerFatal`` and exits, instead of failing
on a message neither side can read: the controller's log names the mismatch,
and the service manager's restart starts the new version whole.
"""
import sys
from multiprocessing.connection import Connection

from homepd.core.protocol import WorkerFatal, wire_fingerprint, worker_mismatch

_conn = Connection(int(sys.argv[1]))
try:
    _spec = _conn.recv()
except EOFError:
    raise SystemExit(0)
except Exception as exc:  # why: a spec pickled by other code (a class moved or renamed) cannot be read at all
    _conn.send(WorkerFatal(error=f"version mismatch: this worker (wire {wire_fingerprint()}) cannot read its "
                                 f"controller's spec ({type(exc).__name__}: {exc}); the package was changed under the "
                                 "running service: restart the service to run the new version"))
    raise SystemExit(2)
_mismatch = worker_mismatch(getattr(_spec, "wire", ""))
if _mismatch is not None:
    _conn.send(WorkerFatal(error=_mismatch))
    raise SystemExit(2)

from homepd.worker.loop import worker_main  # noqa: E402  (why here: only a worker that matches loads the model code)

worker_main(_spec, _conn)
