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
