"""The PyTorch runtime fails fast and cleanly when a worker raises or dies.

A worker that raises (an exception inside its replica's forward pass) and a
worker killed with SIGKILL mid-training must make `fit` raise `WorkerError`
in the user's process within 30 s, naming the rank and its error, and leave no
worker process running.
"""

import os
import signal
import time

import keras
import numpy as np
import pytest

from autodist_keras.testing import FailOnWorker

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)

BATCH = 24
DEADLINE_S = 30.0


def _model(fail_rank=None, after=3, mode="raise"):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    if fail_rank is not None:
        x = FailOnWorker(fail_rank, after, mode=mode)(x)
    outputs = keras.layers.Dense(4)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n=24 * 20):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 4, size=n)


def _strategy(ndev, **options):
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    cluster = Cluster.cpu_testbed()
    return AutoStrategy(strategy="proportional", cluster=cluster, devices=cluster.names[:ndev],
                        **options)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\tZ" not in next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return False


def _assert_all_gone(pids, within_s=10.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], f"worker processes still running: {pids}"


class _Clock(keras.callbacks.Callback):
    """Notes when batch `batch` starts; optionally kills a worker there."""

    def __init__(self, batch, kill=None):
        super().__init__()
        self.batch = batch
        self.kill = kill
        self.started = None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            self.started = time.monotonic()
            if self.kill is not None:
                os.kill(self.kill(), signal.SIGKILL)


def test_worker_that_raises_fails_fit_with_its_rank_and_error():
    from autodist_keras.errors import WorkerError

    strategy = _strategy(3)
    with strategy.scope():
        model = _model(fail_rank=2, after=3)
    x, y = _data()
    clock = _Clock(batch=3)  # rank 2 raises in its 4th step
    with pytest.raises(WorkerError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[clock])
    elapsed = time.monotonic() - clock.started
    assert info.value.rank == 2
    assert "injected failure in rank 2" in str(info.value)
    assert "ValueError" in str(info.value)
    assert elapsed < DEADLINE_S
    _assert_all_gone(list(strategy.adapter.worker_pids().values()))

    # The next fit starts fresh workers and trains.
    strategy = _strategy(3)
    with strategy.scope():
        healthy = _model()
    healthy.fit(x, y, batch_size=BATCH, verbose=0, epochs=1)
    assert strategy.adapter.last_run["in_sync"] is True


def test_killed_worker_fails_fit_within_deadline_and_leaves_no_process():
    from autodist_keras.errors import WorkerError

    strategy = _strategy(2)
    with strategy.scope():
        model = _model()
    x, y = _data()
    clock = _Clock(batch=5, kill=lambda: strategy.adapter.worker_pids()[1])
    with pytest.raises(WorkerError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0, epochs=3, callbacks=[clock])
    elapsed = time.monotonic() - clock.started
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)
    assert elapsed < DEADLINE_S
    _assert_all_gone(list(strategy.adapter.worker_pids().values()))
    # The failed session's gradient hooks are gone: the same model trains on
    # rank 0 alone and in a new fit (a stale hook used the closed pool's group).
    assert not any(v.value._post_accumulate_grad_hooks for v in model.trainable_weights)
    assert np.isfinite(model.train_on_batch(x[:BATCH], y[:BATCH]))
    model.fit(x, y, batch_size=BATCH, verbose=0, epochs=1)
    assert strategy.adapter.last_run["in_sync"] is True


def test_hung_worker_fails_fit_after_timeout_s_and_says_how_to_wait_longer():
    """A worker that blocks without dying is caught by the group timeout (`timeout_s`)."""
    from autodist_keras.errors import WorkerError

    strategy = _strategy(2, timeout_s=5)
    with strategy.scope():
        model = _model(fail_rank=1, after=3, mode="hang")
    x, y = _data()
    clock = _Clock(batch=3)  # rank 1 blocks in its 4th step
    with pytest.raises(WorkerError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[clock])
    elapsed = time.monotonic() - clock.started
    assert 5 <= elapsed < DEADLINE_S
    assert "timeout_s=" in str(info.value) and "(now 5 s)" in str(info.value)
    _assert_all_gone(list(strategy.adapter.worker_pids().values()))


def test_failure_drill_layer_checks_its_mode():
    from autodist_keras.errors import BackendError

    with pytest.raises(BackendError, match="mode must be one of.*Received: mode='explode'"):
        FailOnWorker(mode="explode")


def _listening_socket_inodes():
    """Inodes of this process's TCP sockets in the LISTEN state (from /proc)."""
    return set(_listening_sockets())


def _listening_sockets():
    """This process's listening TCP sockets: {inode: local address (hex, from /proc)}."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    listening = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in mine:  # 0A: LISTEN
                listening[fields[9]] = fields[1]
    return listening


def test_close_releases_sockets_and_threads_while_the_model_still_exists():
    """`adapter.close()` frees the store's socket and the groups' threads at once,
    although the model (and through it the last fit's driver) is still alive."""
    import threading

    from autodist_keras.backends.torch_pool import shutdown_pools

    shutdown_pools()  # so that this fit starts its own workers and store
    before_sockets = _listening_socket_inodes()
    before_threads = threading.active_count()
    strategy = _strategy(3)
    with strategy.scope():
        model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, verbose=0, epochs=1)
    assert _listening_socket_inodes() - before_sockets, "a fit on 3 ranks listens on a store"
    strategy.adapter.close()
    assert not _listening_socket_inodes() - before_sockets
    assert threading.active_count() <= before_threads
    # The same model trains again afterwards, on fresh workers.
    model.fit(x, y, batch_size=BATCH, verbose=0, epochs=1)
    assert strategy.adapter.last_run["in_sync"] is True


def test_worker_that_died_between_fits_gives_a_worker_error_not_a_broken_pipe():
    """A pooled worker killed while idle: waking it fails as a comm failure,
    which a fit reports as a `WorkerError` naming the rank (it was a
    BrokenPipeError); the next fit replaces the pool and trains."""
    from autodist_keras.backends import torch_pool
    from autodist_keras.backends.torch_transport import CommFailure

    strategy = _strategy(2)
    with strategy.scope():
        model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, verbose=0, epochs=1)
    pool = torch_pool.get_pool(2, strategy.adapter.timeout_s)
    pid = pool.pids[1]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pool.processes[1].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    # Waking a dead worker is a comm failure (reported as a WorkerError), never
    # a BrokenPipeError from its control pipe.
    with pytest.raises(CommFailure, match="cannot reach worker 1"):
        pool.wake()
    torch_pool.release_pool(pool)
    model.fit(x, y, batch_size=BATCH, verbose=0, epochs=1)
    assert strategy.adapter.last_run["in_sync"] is True
    assert strategy.adapter.worker_pids()[1] != pid


def test_the_pool_store_listens_on_loopback_only():
    """Rank 0's TCP store accepts connections on 127.0.0.1 only (torch's
    `TCPStore("127.0.0.1", 0, ...)` alone listens on every interface)."""
    from autodist_keras.backends import torch_pool

    torch_pool.shutdown_pools()
    before = set(_listening_sockets())
    pool = torch_pool.get_pool(2, 60)
    try:
        port = f"{pool.store.port:04X}"
        ours = {inode: address for inode, address in _listening_sockets().items()
                if inode not in before and address.endswith(":" + port)}
        assert ours, "the store's listening socket is not in /proc/self/net/tcp"
        # 0100007F is 127.0.0.1 in /proc's byte order; every interface would be 00000000.
        assert set(ours.values()) == {f"0100007F:{port}"}
    finally:
        torch_pool.shutdown_pools()


class _InterruptedPool:
    """Builds a real pool that is interrupted (as by Ctrl-C) after its first worker started."""

    @staticmethod
    def make(world_size):
        from autodist_keras.backends import torch_pool

        started = []

        class Interrupted(torch_pool.WorkerPool):
            def _start_worker(self, ctx, rank, worker_main):
                super()._start_worker(ctx, rank, worker_main)
                started.append(self.processes[rank].pid)
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            Interrupted(world_size, 60)
        return started


def test_ctrl_c_while_workers_start_leaves_no_worker_running():
    """An interrupt between two workers' starts ends the worker already
    started (it was left running, about 340 MB, until the user's process exited)."""
    started = _InterruptedPool.make(3)
    assert len(started) == 1
    _assert_all_gone(started, within_s=5.0)


# ------------------------------------------------------------------ Ctrl-C
CTRL_C_SCRIPT = '''
import json, os, signal, sys, time
import numpy as np
import keras
from autodist_keras import AutoStrategy, Cluster


@keras.saving.register_keras_serializable(package="ctrl_c_script")
class CtrlCInStep(keras.layers.Layer):
    """Presses Ctrl-C (SIGINT to the whole process group) in rank 0's forward pass."""

    armed = False

    def call(self, inputs, training=None):
        if training and CtrlCInStep.armed and "AUTODIST_KERAS_WORKER_RANK" not in os.environ:
            CtrlCInStep.armed = False
            os.killpg(os.getpgrp(), signal.SIGINT)
            time.sleep(10)  # the KeyboardInterrupt comes first
        return inputs


class ArmAtThirdStep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        CtrlCInStep.armed = batch == 2


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fit(model, x, y, callbacks=()):
    model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 16)).astype("float32")
    y = rng.integers(0, 4, size=96)
    cluster = Cluster.cpu_testbed()
    strategy = AutoStrategy("data_parallel", cluster=cluster, devices=cluster.names[:3])
    with strategy.scope():
        inputs = keras.Input((16,))
        hidden = CtrlCInStep()(keras.layers.Dense(16, activation="relu")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, x, y)
    report = {"pids": strategy.adapter.worker_pids()}
    try:  # Ctrl-C between fits, caught by the user's code
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(10)
    except KeyboardInterrupt:
        report["caught_idle"] = True
    time.sleep(1.0)
    report["alive_after_idle"] = [p for p in report["pids"].values() if alive(p)]
    fit(model, x, y)
    report["pids_after_idle"] = strategy.adapter.worker_pids()
    report["in_sync_after_idle"] = strategy.adapter.last_run["in_sync"]
    try:  # Ctrl-C inside a training step
        fit(model, x, y, callbacks=[ArmAtThirdStep()])
    except KeyboardInterrupt:
        report["caught_in_step"] = True
    report["alive_after_step"] = [p for p in report["pids"].values() if alive(p)]
    fit(model, x, y)
    report["pids_at_end"] = strategy.adapter.worker_pids()
    report["in_sync_at_end"] = strategy.adapter.last_run["in_sync"]
    print(json.dumps(report))
'''


def test_ctrl_c_to_the_process_group_spares_idle_workers_and_still_stops_a_fit(tmp_path):
    """Ctrl-C in a terminal reaches every process of the group. Idle workers
    ignore it, so a KeyboardInterrupt the user's code caught between fits
    leaves them serving the next fit (each printed a KeyboardInterrupt
    traceback and died); inside a step it still ends the fit in rank 0, which
    ends the workers, and the next fit trains on new ones."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=root,
               AUTODIST_KERAS_CACHE=str(tmp_path / "cache"))
    # A session of its own: the script's SIGINT reaches its process group only.
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path, start_new_session=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    pids = sorted(report["pids"].values())
    assert len(pids) == 2
    assert report["caught_idle"] is True
    assert sorted(report["alive_after_idle"]) == pids
    assert report["pids_after_idle"] == report["pids"]  # the same workers served the next fit
    assert report["in_sync_after_idle"] is True
    assert report["caught_in_step"] is True
    assert report["alive_after_step"] == []
    assert not set(report["pids_at_end"].values()) & set(pids)
    assert report["in_sync_at_end"] is True
    assert "KeyboardInterrupt" not in result.stderr


def _forkserver_pid(live_processes):
    """Pid of this process's multiprocessing fork server (a child of it)."""
    for pid in live_processes("ppid", os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.forkserver" in f.read():
                    return pid
        except OSError:
            continue
    return None


def test_ctrl_c_inside_a_workers_start_leaves_no_worker_behind(monkeypatch, live_processes):
    """Ctrl-C that lands in `Process.start()` after the fork request went out
    (while it waits for the fork server to send the worker's pid): the pool
    never learns the pid, yet the worker it asked for ends at once, silently,
    because rank 0 closed the worker's status pipe. It waited `timeout_s` for
    the closed store, printed a c10d timeout and lived until rank 0 exited."""
    import multiprocessing.forkserver as forkserver
    import sys

    from autodist_keras.backends import torch_pool

    # A running fork server (started by this warm-up pool if no test did), so
    # that its new children are the workers this test asks for.
    torch_pool.release_pool(torch_pool.get_pool(2, 60))
    server = _forkserver_pid(live_processes)
    if server is None:
        pytest.skip("workers are not started by a fork server here")
    known = set(live_processes("ppid", server))
    real_read_signed = forkserver.read_signed
    interrupted = []

    def read_signed(fd):
        if not interrupted and sys._getframe(1).f_code.co_name == "_launch":
            interrupted.append(fd)
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: a KeyboardInterrupt, here
        return real_read_signed(fd)

    monkeypatch.setattr(forkserver, "read_signed", read_signed)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    left = []
    try:
        with pytest.raises(KeyboardInterrupt):
            torch_pool.WorkerPool(3, 60)
        assert interrupted, "the interrupt did not land in Process.start()"
        time.sleep(1.0)  # the fork server forks the requested worker meanwhile
        deadline = time.monotonic() + 8.0
        while True:
            left = [p for p in live_processes("ppid", server) if p not in known]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert left == [], "a worker whose start was interrupted is still running"
    finally:
        signal.signal(signal.SIGINT, previous)
        for pid in left:
            os.kill(pid, signal.SIGKILL)


@keras.saving.register_keras_serializable(package="test_runtime_torch_failures")
class RaiseOnRank0(keras.layers.Layer):
    """Identity layer that raises in rank 0's forward pass once armed."""

    armed = False

    def call(self, inputs, training=None):
        if training and RaiseOnRank0.armed and "AUTODIST_KERAS_WORKER_RANK" not in os.environ:
            RaiseOnRank0.armed = False
            raise RuntimeError("user layer failed on rank 0")
        return inputs


class _ArmAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            RaiseOnRank0.armed = True


def _shared_files_mapped():
    """The library's /dev/shm files this process maps."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if "/dev/shm/autodist_keras_" in line}


def test_a_fit_that_fails_inside_a_step_unmaps_its_shared_memory_and_frees_the_model():
    """A step that raises on rank 0 discards the workers; rank 0's mappings of
    the session's (unlinked) shared files go with them, and the model can be
    collected. Both stayed until the next fit or the strategy's end (20 MiB of
    /dev/shm for a 1.3M-parameter model)."""
    import gc
    import weakref

    strategy = _strategy(3)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((16,))
        hidden = RaiseOnRank0()(keras.layers.Dense(64, activation="relu")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(24 * 6)
    failed = False
    try:
        model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[_ArmAt(3)])
    except RuntimeError as e:
        failed = "user layer failed on rank 0" in str(e)
    assert failed
    assert strategy.adapter.last_run["gradient_transport"] == "shared_memory"
    assert _shared_files_mapped() == set()
    _assert_all_gone(list(strategy.adapter.worker_pids().values()))
    collected = weakref.ref(model)
    del model
    gc.collect()
    assert collected() is None


def test_a_worker_that_started_and_died_is_not_said_to_have_failed_importing_the_script():
    """A worker that exits before its main function runs is reported as failing to
    import the main script; one that started (it says so first thing) and died
    later is reported as before, with its exit only."""
    from autodist_keras.errors import WorkerError

    strategy = _strategy(2)
    with strategy.scope():
        model = _model()
    x, y = _data()
    clock = _Clock(batch=2, kill=lambda: strategy.adapter.worker_pids()[1])
    with pytest.raises(WorkerError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0, epochs=1, callbacks=[clock])
    assert info.value.rank == 1
    assert str(info.value) == "Worker rank 1 failed: process was killed by SIGKILL (exit code -9)"
    _assert_all_gone(list(strategy.adapter.worker_pids().values()))
