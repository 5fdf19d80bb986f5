"""Worker processes spawned by rank 0, and the monitor that watches them.

`WorkerPool(world_size)` starts ranks 1..world_size-1 as fresh processes
(forked from a fork server that imported Keras and PyTorch once, on CPU; with
the `spawn` start method on GPU), hosts the TCP store on a free port of
127.0.0.1 (listening on loopback only), and builds rank 0's `Comm` once every
worker has joined. Pools are kept (per world size, gradient backend and
timeout) between `fit` calls of the same process, so only the first fit pays
for starting Python, PyTorch and Keras in the workers. Idle pools of at most
`TIMEOUTS_KEPT` timeouts are kept per world size and gradient backend: a pool
for yet another timeout ends the idle ones of the timeout used least recently,
so a search that gives every trial its own `timeout_s` does not pile up
workers. A pool serves one fit at a time: a fit started inside another (from a
callback) leases a second pool. They are ended at interpreter exit, by
`shutdown_pools()`, or as soon as one of them fails.

The monitor thread watches each worker's process sentinel and status pipe. When
a worker dies or reports an error, it records why and, after a short grace
period, terminates the other workers, so rank 0 (possibly blocked in a
collective) gets an immediate connection error. `diagnose()` turns the record
into a `WorkerError` naming the failing rank and its error.

Example:

```python
pool = get_pool(world_size=3, timeout_s=120)   # leased to this fit
pool.wake()                 # the workers enter a session
...
release_pool(pool)          # the next fit may use it
shutdown_pools()
```
"""

import atexit
import os
import re
import signal
import sys
import threading
import time

from autodist_keras.backends.torch_session import Reporter
from autodist_keras.backends.torch_transport import loopback_store
from autodist_keras.errors import BackendError
from autodist_keras.errors import WorkerError

GRACE_S = 1.0
STARTUP_TIMEOUT_S = 300.0
# How long `close` waits, after closing the status pipes, before it drops the
# store when a worker's start was interrupted (its pid unknown): that worker
# ends as its pipe closes, and would otherwise print the store's loss first.
UNKNOWN_WORKER_EXIT_S = 0.5
# Idle pools of this many timeouts are kept per (world size, gradient backend):
# two strategies that differ only in timeout_s, fitted in turn, keep their
# workers; a third timeout ends the idle pools of the least recently used one.
TIMEOUTS_KEPT = 2

_pools = {}
_pools_lock = threading.Lock()


def get_pool(world_size, timeout_s, grad_backend="gloo"):
    """Leases a healthy pool of `world_size - 1` idle workers, starting one if needed.

    Pools are kept per world size, gradient backend and `timeout_s` (the
    groups' timeout is fixed when they are made), so strategies with other
    timeouts do not restart each other's workers. A pool leased to a fit that
    is still running (a fit started from another fit's callback, such as a
    linear probe trained at each epoch's end) is never handed out again: the
    inner fit gets a pool of its own, kept for its next time. Give the lease
    back with `release_pool` when the fit ends.

    Before it starts a new pool, the idle pools of other timeouts beyond
    `TIMEOUTS_KEPT - 1` (for this world size and backend, least recently used
    first) are ended: a hyper-parameter search with a new `timeout_s` per
    trial kept every trial's workers until exit (14 processes after 8 trials).

    Example:

    ```python
    pool = get_pool(world_size=2, timeout_s=60)
    try:
        pool.wake()
        ...
    finally:
        release_pool(pool)
    ```

    Args:
        world_size: Number of ranks including rank 0.
        timeout_s: How long an operation may wait for a peer.
        grad_backend: `"gloo"` or `"nccl"`.

    Returns:
        A `WorkerPool`, marked in use.
    """
    key = (int(world_size), grad_backend, float(timeout_s))
    with _pools_lock:
        pools = _pools.setdefault(key, [])
        for pool in list(pools):
            if not pool.in_use and not pool.healthy():
                pools.remove(pool)
                pool.close(graceful=False)
        pool = next((p for p in pools if not p.in_use and not p.close_when_released), None)
        if pool is None:
            _end_idle_pools_of_other_timeouts(key)
            pool = WorkerPool(world_size, timeout_s, grad_backend)
            pools.append(pool)
        pool.in_use = True
        pool.last_leased = time.monotonic()
        return pool


def _end_idle_pools_of_other_timeouts(key):
    """Ends idle pools of `key`'s world size and backend but other timeouts, so
    that with `key`'s those of at most `TIMEOUTS_KEPT` timeouts remain (least
    recently leased first). Call with `_pools_lock` held."""
    family = {}
    for other, pools in _pools.items():
        idle = [p for p in pools if not p.in_use]
        if other[:2] == key[:2] and other != key and idle:
            family[other] = idle
    ranked = sorted(family, key=lambda k: max(p.last_leased for p in family[k]), reverse=True)
    for other in ranked[max(TIMEOUTS_KEPT - 1, 0):]:
        for pool in family[other]:
            _pools[other].remove(pool)
            pool.close(graceful=True)
        if not _pools[other]:
            del _pools[other]


def release_pool(pool):
    """Gives back a pool leased with `get_pool` (its workers stay for the next fit,
    unless `shutdown_pools(idle_only=True)` ran meanwhile: then they end now)."""
    with _pools_lock:
        pool.in_use = False
        closing = pool.close_when_released
        if closing:
            _forget(pool)
    if closing:
        pool.close(graceful=True)


def discard_pool(pool, graceful=False):
    """Ends `pool`'s workers (killed unless `graceful`) and forgets it."""
    with _pools_lock:
        _forget(pool)
    pool.close(graceful=graceful)


def _forget(pool):
    """Drops `pool` from the kept pools. Call with `_pools_lock` held."""
    for pools in _pools.values():
        if pool in pools:
            pools.remove(pool)


def shutdown_pools(idle_only=False):
    """Ends the worker processes this process started (all of them at exit).

    Args:
        idle_only: End only the pools no fit is using; a pool leased to a
            running fit (another strategy's, say) ends when that fit gives it
            back.
    """
    with _pools_lock:
        pools = []
        for key in list(_pools):
            for pool in list(_pools[key]):
                if idle_only and pool.in_use:
                    pool.close_when_released = True
                    continue
                _pools[key].remove(pool)
                pools.append(pool)
            if not _pools[key]:
                del _pools[key]
    for pool in pools:
        pool.close(graceful=True)


atexit.register(shutdown_pools)


def _describe_exit(code):
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process was killed by {name} (exit code {code})"
    return f"process exited with code {code}"


_MAIN_GUARD = re.compile(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""")


def main_script_path():
    """The file each spawned process imports as the main module, or None.

    Mirrors `multiprocessing.spawn.get_preparation_data`: a main module run
    by name (`python -m pkg.train`, a zip application) is imported by that
    name, so it has no such path; otherwise it is `__main__.__file__` (a
    `"<stdin>"`-like name included).
    """
    from multiprocessing import process

    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not path:
        return None
    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None and not path.startswith("<"):
        path = os.path.join(process.ORIGINAL_DIR, path)
    return path


def check_main_guard(caller=None, error=BackendError):
    """Raises when the spawned processes could not import the user's main script,
    or would run it again.

    Workers are started with `forkserver` or `spawn`, which import the main
    module of rank 0 (so that layers, losses and functions defined in the
    user's script exist in the workers). A script whose training code is not
    under `if __name__ == "__main__":` would then run it again in each worker,
    which Python refuses with an error deep inside `multiprocessing`; a script
    that is not a file the workers can read again (read from standard input, a
    pipe as `python <(...)` makes, a file deleted since) makes each worker
    fail with a traceback. This check says so up front. Interactive sessions
    (no main file) pass, and so does a compiled (`.pyc`) script, whose guard
    cannot be read.

    Args:
        caller: `None` for `fit` (the message speaks of the PyTorch runtime's
            workers and of training); otherwise the public call that spawns
            the processes, e.g. `"profile_collectives()"`, named instead.
        error: The exception class to raise, for callers whose errors are of
            another type (the profiler raises `EstimatorError`).

    Raises:
        BackendError: (or `error`) If the main script has no
            `__name__ == "__main__"` test, was read from standard input or a
            pipe, or no longer exists.
    """
    import stat

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if caller is None:
        starts = ("The PyTorch runtime starts one worker process per extra device, and each "
                  "worker imports")
        code = "the code that builds and fits the model"
        rerun = "the worker would run your training code again"
        alternative = ", or launch the ranks yourself with torchrun"
        who, name = "the workers", "train.py"
        needs = "torch.multiprocessing needs too"
        until = "the fit ends"
    else:
        starts = f"{caller} starts child processes, and each imports"
        code = f"the code that calls {caller}"
        rerun = f"each child would run your script again, {caller} included"
        alternative = ""
        who, name = "the children", "script.py"
        needs = "multiprocessing's spawn start method needs"
        until = f"{caller} returns"
    if isinstance(path, str) and path.startswith("<"):
        # `python - < train.py`: the workers would try to import a file named "<stdin>".
        raise error(
            f"{starts} your main script; yours was read from "
            f"{path}, which {who} cannot import. Save it as a .py file and run "
            f"`python {name}`. "
            f"Received: __main__.__file__={path!r}"
        )
    if not isinstance(path, str) or not path or getattr(sys, "frozen", False):
        return  # (a frozen app's children do not read its main path again)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__"):
        return  # `python -m pkg`, `python dir/`: multiprocessing re-imports nothing
    spawned_path = main_script_path()
    path = spawned_path or path
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if spawned_path is not None and (mode is None or not stat.S_ISREG(mode)):
        if mode is None:
            what = ("no longer exists (it was deleted or moved after Python started), so "
                    f"{who} cannot import it. Keep the script in place until {until}")
        else:
            kind = ("a pipe (as `python <(...)` or `python /dev/stdin` make)"
                    if stat.S_ISFIFO(mode) else "not a regular file")
            what = (f"is {kind}, which {who} cannot read again. Save the script as a .py "
                    f"file and run `python {name}`")
        raise error(
            f"{starts} your main script; yours, {path}, {what}. "
            f"Received: __main__.__file__={path!r}"
        )
    if mode is None or not stat.S_ISREG(mode):
        return
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return
    if b"\0" in raw:
        return  # a compiled script (`python train.pyc`): no source to read the guard in
    source = raw.decode("utf-8", errors="replace")
    if _MAIN_GUARD.search(source):
        return
    raise error(
        f"{starts} your script ({path}) so that what it defines exists there too; without a "
        f"main guard {rerun}. Put {code} under `if __name__ == \"__main__\":` (as "
        f"{needs}){alternative}. "
        f"Received: no `if __name__ == \"__main__\":` block in {path}"
    )


def _main_script_name():
    """How `_exited_while_importing_main` names the main module the workers import."""
    path = main_script_path()
    if path is not None:
        return path
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return f"module {name}" if name else "__main__"


def _exited_while_importing_main(exit_text, start_method):
    """The `WorkerError` text for a worker that ended before its main function ran.

    `multiprocessing` imports rank 0's main module in each new worker before it
    calls `torch_worker.worker_main` (whose first act is to say it started);
    a worker that ended without saying so failed there, and its traceback went
    to stderr only.
    """
    script = _main_script_name()
    if exit_text.startswith("process was killed"):
        why = ("Something outside it ended it (the kernel's out-of-memory killer, "
               "a signal sent to it).")
    else:
        why = ("The traceback above on stderr says why. Commonly the script runs its "
               "training code at module level, outside `if __name__ == \"__main__\":` (a "
               "guard further down does not cover the code above it): put the code that "
               "builds and fits the model under the guard, so that importing the script "
               "only defines things.")
    return (
        f"{exit_text} while starting (importing your main script, {script}, or the "
        "worker's own modules), before it reached the worker's main function: each worker "
        f"({start_method} start method) re-imports `__main__`, as torch.multiprocessing "
        f"does, so that what the script defines exists there too. {why} Received: worker "
        f"exit before start-up, main script {script!r}"
    )


def _context(grad_backend):
    """`forkserver` (preloading Keras and PyTorch once) for CPU workers, else `spawn`.

    A fork server imports what workers need a single time, so each worker
    starts in well under a second. GPU workers are spawned fresh, because a
    process that probed CUDA must not be forked.
    """
    import multiprocessing

    if grad_backend == "gloo" and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["__main__", "autodist_keras.backends.torch_preload"])
        return ctx
    return multiprocessing.get_context("spawn")


class WorkerPool(Reporter):
    """Spawned worker processes for ranks 1..world_size-1 and rank 0's `Comm`.

    Args:
        world_size: Number of ranks including rank 0 (this process).
        timeout_s: How long an operation may wait for a peer.
        grad_backend: `"gloo"` or `"nccl"`.

    Raises:
        WorkerError: If a worker fails to start.
    """

    def __init__(self, world_size, timeout_s, grad_backend="gloo"):
        from autodist_keras.backends.torch_worker import worker_main

        check_main_guard()
        self.world_size = int(world_size)
        self.timeout_s = float(timeout_s)
        self.grad_backend = grad_backend
        self._lock = threading.Lock()
        self._events = []  # dicts: time, rank, kind ("error" | "exit"), message, secondary
        self._terminated_by_us = set()
        self._closing = False
        self._unknown_starts = 0  # workers whose start was interrupted before their pid came
        self._started = set()  # ranks whose worker_main runs (their main module imported)
        self._ready = set()
        self.comm = None
        self.in_use = False  # leased to a running fit (`get_pool`)
        self.last_leased = time.monotonic()  # when `get_pool` last handed it out
        self.close_when_released = False  # `shutdown_pools(idle_only=True)` ran meanwhile
        startup = max(STARTUP_TIMEOUT_S, self.timeout_s)
        self.store = loopback_store(self.world_size, startup)
        ctx = _context(grad_backend)
        self.start_method = ctx.get_start_method()
        self.processes = {}
        self._ctl = {}
        self._status = {}
        self._monitor = None
        try:
            # Everything from the first worker's start on is undone by `close`
            # when it fails or is interrupted (Ctrl-C while workers start), so
            # no worker outlives a pool that never formed.
            for rank in range(1, self.world_size):
                self._start_worker(ctx, rank, worker_main)
            self._monitor = threading.Thread(
                target=self._watch, name="autodist_keras-monitor", daemon=True
            )
            self._monitor.start()
            self.comm = self._connect(startup)
        except BaseException:
            self.close(graceful=False)
            raise

    def _start_worker(self, ctx, rank, worker_main):
        ctl_r, ctl_w = ctx.Pipe(duplex=False)
        st_r, st_w = ctx.Pipe(duplex=False)
        self._ctl[rank] = ctl_w
        self._status[rank] = st_r
        process = ctx.Process(
            target=worker_main,
            args=(rank, self.world_size, self.store.port, ctl_r, st_w, os.getpid(),
                  self.timeout_s, self.grad_backend),
            name=f"autodist_keras-worker-{rank}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            if process.pid is None:
                # Ctrl-C while `start()` waited for the fork server's answer: the
                # worker may still be forked, with no pid here to end it by. It
                # ends itself once `close` closes its status pipe (`st_r`, kept
                # in `_status`: torch_worker.watch_parent).
                self._unknown_starts += 1
            raise
        finally:
            if process.pid is not None:
                self.processes[rank] = process
            ctl_r.close()
            st_w.close()

    # ------------------------------------------------------------ start-up
    def _connect(self, startup):
        from autodist_keras.backends.torch_transport import Comm

        result = {}

        def build():
            try:
                result["comm"] = Comm(self.store, 0, self.world_size, self.timeout_s, self.grad_backend)
            except BaseException as e:  # noqa: BLE001
                result["error"] = e

        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        deadline = time.monotonic() + startup
        while thread.is_alive():
            thread.join(0.1)
            if self.failed():
                raise self.diagnose(wait_s=0.5)
            if time.monotonic() > deadline:
                raise WorkerError(
                    "unknown",
                    f"the workers did not join within {startup:.0f} s of starting. "
                    "Check that this machine can start Python processes and that "
                    "127.0.0.1 is reachable.",
                )
        if "error" in result:
            if self.failed():
                raise self.diagnose(wait_s=0.5)
            raise WorkerError("unknown", f"the process group could not form: {result['error']}")
        return result["comm"]

    # ------------------------------------------------------------- monitor
    def _watch(self):
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: r for r, p in self.processes.items()}
        pipes = {conn: r for r, conn in self._status.items()}
        first_failure = None
        while True:
            if self._closing and not sentinels:
                return
            waitables = list(sentinels) + list(pipes)
            if not waitables:
                return
            try:
                ready = wait(waitables, timeout=0.2)
            except (OSError, ValueError):
                return
            for obj in ready:
                if obj in pipes:
                    self._read_status(obj, pipes)
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    # What the worker sent before it ended comes first (whether
                    # it started, its error), whatever order `wait` returned.
                    conn = self._status.get(rank)
                    while conn in pipes and self._read_status(conn, pipes, block=False):
                        pass
                    code = self.processes[rank].exitcode
                    if not self._closing and rank not in self._terminated_by_us:
                        self._record(rank, "exit", _describe_exit(code), False)
            if first_failure is None and self.failed():
                first_failure = time.monotonic()
            if first_failure is not None and not self._closing:
                if time.monotonic() - first_failure >= GRACE_S:
                    self._terminate_all()
                    self._abort_gradient_groups()

    def _read_status(self, conn, pipes, block=True):
        """Handles one message of a worker's status pipe.

        Args:
            conn: The pipe's read end (a key of `pipes`).
            pipes: `{conn: rank}` of the pipes still open; a closed one is removed.
            block: Wait for a message; otherwise return False when none is there.

        Returns:
            True if a message was handled.
        """
        rank = pipes[conn]
        try:
            if not block and not conn.poll():
                return False
            kind, r, message, secondary = conn.recv()
        except (EOFError, OSError, ValueError):
            del pipes[conn]
            return False
        if kind == "started":
            self._started.add(r)
        elif kind == "ready":
            self._ready.add(r)
        else:
            self._record(rank, "error", message, secondary)
        return True

    def _abort_gradient_groups(self):
        """Frees rank 0 from NCCL collectives whose peers are gone (see `Comm`)."""
        comm = self.comm
        if comm is not None:
            comm.abort_gradient_groups()

    def _record(self, rank, kind, message, secondary):
        with self._lock:
            self._events.append({
                "time": time.monotonic(), "rank": rank, "kind": kind,
                "message": message, "secondary": secondary,
            })

    def failed(self):
        """True once any worker died or reported an error."""
        with self._lock:
            return bool(self._events)

    def healthy(self):
        return (
            self.comm is not None and not self.comm.broken and not self.failed()
            and not self._closing
            and all(p.is_alive() for p in self.processes.values())
        )

    # ------------------------------------------------------------ reporting
    def report(self, rank, message, secondary):
        self._record(rank, "error", message, secondary)

    def diagnose(self, failure=None, wait_s=5.0):
        """Waits briefly for a worker's report and returns the `WorkerError` to raise."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if any(not e["secondary"] for e in self._events):
                    break
            time.sleep(0.05)
        with self._lock:
            events = list(self._events)
        primary = [e for e in events if not e["secondary"]]
        chosen = (primary or events or [None])[0]
        if chosen is None:
            peer = getattr(failure, "peer", None)
            return WorkerError(
                peer if peer is not None else "unknown",
                f"communication failed and no worker reported an error: {failure}. If a "
                "worker was busy rather than stuck (a slow first step, a long data load), "
                f"raise AutoStrategy(..., timeout_s=...) (now {self.timeout_s:g} s)",
            )
        rank = chosen["rank"]
        messages = [e["message"] for e in events if e["rank"] == rank and e["kind"] == "error"]
        exits = [e["message"] for e in events if e["rank"] == rank and e["kind"] == "exit"]
        text = "\n".join(messages) if messages else "; ".join(exits)
        if messages and exits:
            text += f"\n({exits[0]})"
        elif exits and rank not in self._started:
            text = _exited_while_importing_main(exits[0], self.start_method)
        return WorkerError(rank, text)

    # ------------------------------------------------------------- control
    def wake(self):
        """Tells every worker a session (one fit) starts.

        Raises:
            CommFailure: A worker's pipe is closed (it died since the last fit
                and the pool has not noticed yet); the caller reports it as a
                `WorkerError`.
        """
        from autodist_keras.backends.torch_transport import CommFailure

        for rank, conn in self._ctl.items():
            if not self.processes[rank].is_alive():
                raise CommFailure(f"cannot reach worker {rank}: it has exited", peer=rank)
            try:
                conn.send("session")
            except OSError as e:
                raise CommFailure(f"cannot reach worker {rank}: {e}", peer=rank) from None

    @property
    def pids(self):
        """Process ids of the workers, by rank."""
        return {r: p.pid for r, p in self.processes.items()}

    def _terminate_all(self):
        for rank, process in self.processes.items():
            if process.is_alive():
                self._terminated_by_us.add(rank)
                process.terminate()

    def close(self, graceful=True):
        """Ends the workers: asks them to exit, then terminates and kills stragglers.

        Closing the status pipes also ends a worker whose start was
        interrupted before its pid was known (it watches its pipe).

        Args:
            graceful: Ask the workers to exit first (3 s) instead of
                terminating them at once.
        """
        if self._closing:
            return
        self._closing = True
        if graceful:
            for conn in self._ctl.values():
                try:
                    conn.send("exit")
                except (OSError, BrokenPipeError):
                    pass
            deadline = time.monotonic() + 3.0
            for process in self.processes.values():
                process.join(max(0.0, deadline - time.monotonic()))
        for rank, process in self.processes.items():
            if process.is_alive():
                self._terminated_by_us.add(rank)
                process.terminate()
        for process in self.processes.values():
            process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        monitor = self._monitor
        if monitor is not None and monitor.is_alive() and monitor is not threading.current_thread():
            monitor.join(2.0)
        # Closing the status pipes' read ends also ends any worker this pool
        # asked for but never learnt the pid of (torch_worker.watch_parent).
        for conn in list(self._ctl.values()) + list(self._status.values()):
            try:
                conn.close()
            except OSError:
                pass
        if self._unknown_starts:
            time.sleep(UNKNOWN_WORKER_EXIT_S)  # ... before the store it may wait on goes
        if not graceful:
            self._abort_gradient_groups()
        if self.comm is not None:
            self.comm.release()
        self.comm = None
        self.store = None
