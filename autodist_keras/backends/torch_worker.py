"""Entry point of a worker process spawned by the PyTorch runtime.

A worker is started by `torch_pool.WorkerPool` (forked from a fork server that
preloaded Keras and PyTorch on CPU, a fresh `spawn` process on GPU).
It first tells rank 0 that it started (its main module, which `multiprocessing`
imports before calling `worker_main`, imported), places nothing on any device
until a session tells it to, joins rank 0's
process groups, and then loops: wait on its control pipe for the next fit
("session"), serve that session (`torch_session.serve`), and wait again. Any
error is reported through its status pipe before the process exits, so rank 0
can raise it as a `WorkerError`. A watchdog thread ends the worker if its parent
disappears, so no worker outlives the user's process, and also when rank 0 has
closed its end of the worker's status pipe (a pool that was closed, or whose
start-up was interrupted before it learnt the worker's process id), so no
worker outlives its pool either.

Workers ignore SIGINT: Ctrl-C in a terminal reaches every process of the
foreground group, and rank 0 alone decides what it means (it ends or replaces
the workers when the interrupt stops a fit, and keeps them when the user's
code caught it between fits).

This module imports neither Keras nor PyTorch at import time: the worker sets
`KERAS_BACKEND=torch` before importing them.
"""

import os
import signal
import sys
import threading
import time

from autodist_keras.backends.processes import process_alive
from autodist_keras.backends.processes import reader_gone


class PipeReporter:
    """Reports a worker's failure to rank 0's monitor through a pipe."""

    def __init__(self, conn):
        self.conn = conn

    def report(self, rank, message, secondary):
        try:
            self.conn.send(("error", int(rank), str(message), bool(secondary)))
        except (OSError, EOFError, BrokenPipeError):
            pass


def watch_parent(parent_pid, pipe=None):
    """Ends this process within 0.5 s of `parent_pid` ending; runs forever.

    Run it in a daemon thread of a child process: a parent killed outright
    (SIGKILL) cleans up nothing, and its children would live on. Spawned
    workers are children of rank 0; forked ones are children of the fork
    server. Either way, a worker ends (exit code 1) when rank 0 is gone.

    With `pipe`, the process also ends (exit code 0, silently) once nobody
    reads that pipe any more: rank 0 closes the read ends of a pool's status
    pipes when it closes the pool, and a worker whose start was interrupted
    (Ctrl-C while `Process.start()` waited for the fork server's answer) is
    one rank 0 never learnt the process id of, so this is how it learns that
    nobody waits for it. It would otherwise wait `timeout_s` for a store that
    is gone and print a c10d timeout into the user's terminal.

    Example:

    ```python
    threading.Thread(target=watch_parent, args=(parent_pid, status_conn),
                     daemon=True).start()
    ```

    Args:
        parent_pid: The process id to watch.
        pipe: Optional write end (a `multiprocessing` `Connection`) of a pipe
            whose read end belongs to the parent.
    """
    start_ppid = os.getppid()
    fd = pipe.fileno() if pipe is not None else None
    while True:
        if os.getppid() != start_ppid or not process_alive(parent_pid):
            os._exit(1)
        if fd is None:
            time.sleep(0.5)
        elif reader_gone(fd, timeout_s=0.5):  # wakes as soon as rank 0 closes its end
            os._exit(0)


def worker_main(rank, world_size, port, ctl_conn, status_conn, parent_pid, timeout_s, grad_backend):
    """Runs one spawned worker (rank > 0) until told to exit or its parent goes.

    Args:
        rank: This worker's rank.
        world_size: Number of ranks.
        port: Port of rank 0's TCP store on 127.0.0.1.
        ctl_conn: Pipe end on which rank 0 sends "session" / "exit".
        status_conn: Pipe end for reports to rank 0.
        parent_pid: Rank 0's process id.
        timeout_s: How long an operation may wait for a peer.
        grad_backend: `"gloo"` or `"nccl"`.
    """
    # Ctrl-C reaches the whole process group; rank 0 ends the workers if it
    # stops a fit (a traceback per worker said nothing, and idle workers died
    # although the user's code caught the interrupt).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Rank 0 learns that this process got past importing its main module (which
    # `multiprocessing` does before calling this function): a worker that exits
    # without this message failed there, and rank 0 says so (torch_pool.diagnose).
    try:
        status_conn.send(("started", int(rank), "", False))
    except (OSError, EOFError):
        pass
    os.environ["KERAS_BACKEND"] = "torch"
    os.environ["AUTODIST_KERAS_WORKER_RANK"] = str(rank)
    threading.Thread(target=watch_parent, args=(parent_pid, status_conn), daemon=True).start()
    reporter = PipeReporter(status_conn)
    try:
        import datetime

        import keras  # noqa: F401 - imported before serving, so the first fit is not slowed
        import torch.distributed as dist

        from autodist_keras.backends.torch_session import serve
        from autodist_keras.backends.torch_transport import Comm
        from autodist_keras.backends.torch_transport import CommFailure

        store = dist.TCPStore(
            "127.0.0.1", int(port), int(world_size), False,
            timeout=datetime.timedelta(seconds=float(timeout_s)),
        )
        comm = Comm(store, rank, world_size, timeout_s, grad_backend=grad_backend)
        status_conn.send(("ready", int(rank), "", False))
    except BaseException as e:  # noqa: BLE001 - start-up failure: report and leave
        from autodist_keras.backends.torch_session import format_exception

        reporter.report(rank, "worker start-up failed: " + format_exception(e), False)
        sys.stderr.flush()
        os._exit(1)

    while True:
        try:
            message = ctl_conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if message == "exit":
            break
        if message != "session":
            continue
        try:
            serve(comm, reporter)
        except BaseException as e:  # noqa: BLE001 - the session is lost: report and leave
            from autodist_keras.backends.torch_session import format_exception

            reporter.report(rank, format_exception(e), isinstance(e, CommFailure))
            sys.stderr.flush()
            os._exit(1)
    os._exit(0)
