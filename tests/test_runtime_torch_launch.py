"""A torchrun-style launch: the same script started twice with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set (by `autodist_keras.launch`, on a free port).

Both ranks must end with the weights of single-device training, although rank 1
builds its model from a different random seed (rank 0's initial state wins),
and rank 1's `fit` must return rank 0's History.
"""

import json
import os
import sys
import textwrap

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import keras
    from autodist_keras import AutoStrategy
    from autodist_keras.devices import Cluster

    def build():
        inputs = keras.Input((16,))
        x = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
        return keras.Model(inputs, keras.layers.Dense(4, name="logits")(x))

    def data():
        rng = np.random.default_rng(0)
        return rng.normal(size=(98, 16)).astype("float32"), rng.integers(0, 4, size=98)

    if __name__ == "__main__":
        out, rank = sys.argv[1], int(os.environ["RANK"])
        cluster = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}])
        strategy = AutoStrategy(strategy="proportional", cluster=cluster, speeds={
            "node0/cpu0": 2.0, "node0/cpu1": 1.0}, timeout_s=120)
        keras.utils.set_random_seed(1 + 100 * rank)
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data()
        history = model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        np.savez(os.path.join(out, f"rank{rank}.npz"), *model.get_weights())
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"history": history.history, "run": strategy.adapter.last_run,
                       "shares": strategy.plan.shares_for(24)}, f)
""")


def test_two_ranks_launched_like_torchrun_match_single_device(tmp_path):
    from autodist_keras.launch import launch

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {"KERAS_BACKEND": "torch",
           "PYTHONPATH": os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])}
    result = launch(str(script), nprocs=2, args=[str(tmp_path)], env=env, timeout_s=240)
    assert result.ok, result

    namespace = {}
    exec(compile(SCRIPT.replace('if __name__ == "__main__":', "if False:"), "train", "exec"), namespace)
    keras.utils.set_random_seed(1)
    reference = namespace["build"]()
    reference.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = namespace["data"]()
    ref_history = reference.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)

    for rank in (0, 1):
        with np.load(tmp_path / f"rank{rank}.npz", allow_pickle=False) as saved:
            weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        for got, want in zip(weights, reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        with open(tmp_path / f"rank{rank}.json") as f:
            info = json.load(f)
        assert info["run"]["mode"] == "torchrun"
        assert info["shares"] == [16, 8]
        np.testing.assert_allclose(info["history"]["loss"], ref_history.history["loss"], rtol=1e-5)
    with open(tmp_path / "rank0.json") as f:
        assert json.load(f)["run"]["in_sync"] is True


FAILING = textwrap.dedent("""
    import os, sys, time


    def callbacks(rank, mode):
        import keras

        class Boom(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    raise ValueError("rank 0's callback failed")

        class Die(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 2:
                    os._exit(3)

        return ([Die()] if mode == "die" else [Boom()]) if rank == 0 else []


    if __name__ == "__main__":
        out, mode, rank = sys.argv[1], sys.argv[2], int(os.environ["RANK"])
        with open(os.path.join(out, f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        if mode == "sleep":
            time.sleep(120)
        if mode == "skip" and rank == 1:
            sys.exit(0)  # never calls fit (nor imports Keras: not needed to say so)
        import numpy as np
        import keras
        from autodist_keras import AutoStrategy
        from autodist_keras.devices import Cluster

        cluster = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}])
        strategy = AutoStrategy(strategy="data_parallel", cluster=cluster, timeout_s=15)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(64, 4)), rng.normal(size=(64, 2))
        # "unbuilt,callback,die": one fit after the other in the same ranks (a failed
        # fit leaves the ranks able to fit again); each writes `rank{rank}-{mode}.txt`.
        for step in mode.split(","):
            with strategy.scope():
                if step == "unbuilt":  # weights made at the first call
                    model = keras.Sequential([keras.layers.Dense(2)])
                else:
                    inputs = keras.Input((4,))
                    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
                model.compile(optimizer="sgd", loss="mse")
            try:
                model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                          callbacks=callbacks(rank, step))
                outcome = "completed"
            except Exception as e:
                outcome = f"{type(e).__name__}: {e}"
            with open(os.path.join(out, f"rank{rank}-{step}.txt"), "w") as f:
                f.write(outcome)
""")


def _run_failing(tmp_path, mode):
    from autodist_keras.launch import launch

    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = {"KERAS_BACKEND": "torch",
           "PYTHONPATH": os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])}
    return launch(str(script), nprocs=2, args=[str(tmp_path), mode], env=env, timeout_s=200)


def test_a_rank_that_never_calls_fit_is_reported_after_timeout_s(tmp_path):
    import time

    started = time.monotonic()
    _run_failing(tmp_path, "skip")
    waited = time.monotonic() - started
    message = (tmp_path / "rank0-skip.txt").read_text()
    assert message.startswith("BackendError") and "waited 15 s" in message, message
    assert "Every rank must run the script to its fit" in message
    assert waited < 150


def test_failing_ranks_say_what_is_wrong_and_stop_every_rank(tmp_path):
    """One launch (`autodist-keras launch`), three fits in turn in the same two ranks
    (each case on its own would cost the ranks' start-up again):

    - A model not built before fit: rank 0 builds it at its first batch; the other
      ranks see no data. The error said the ranks had built different models
      ("0 weights but rank 0's has 2").
    - A built model whose fit fails on rank 0 (its callback raises): the other
      rank's fit raises too.
    - Rank 0 dies mid-fit: rank 1 raises a WorkerError naming rank 0 and exits
      quietly: its exit hook no longer writes to the store that died with rank 0
      (which printed a C++ "sendBytes failed" stack)."""
    import subprocess

    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = dict(os.environ, KERAS_BACKEND="torch")
    done = subprocess.run(
        [sys.executable, "-m", "autodist_keras.cli", "launch", "--nprocs", "2", str(script),
         str(tmp_path), "unbuilt,callback,die"], env=env, capture_output=True, text=True,
        timeout=200)
    output = done.stdout + done.stderr
    message = (tmp_path / "rank0-unbuilt.txt").read_text()
    assert message.startswith("WorkerError") and "has no weights yet" in message, message
    assert "model(x[:1])" in message
    assert (tmp_path / "rank0-callback.txt").read_text().startswith(
        "ValueError: rank 0's callback failed")
    other = (tmp_path / "rank1-callback.txt").read_text()
    assert other.startswith("WorkerError") and "stopped with an error" in other, other
    assert done.returncode != 0
    assert "rank 0 failed first" in output, output
    assert not (tmp_path / "rank0-die.txt").exists()
    message = (tmp_path / "rank1-die.txt").read_text()
    assert message.startswith("WorkerError: Worker rank 0 failed"), message
    assert "sendBytes" not in output and "Exception raised from" not in output, output


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    import signal
    import subprocess
    import time

    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = dict(os.environ, KERAS_BACKEND="torch")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "autodist_keras.cli", "launch", "--nprocs", "2", str(script),
         str(tmp_path), "sleep"], env=env)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pids), "rank processes outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive([int(p.read_text()) for p in tmp_path.glob("pid*")]):
            os.kill(pid, signal.SIGKILL)


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


RANK_0_ALONE = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import keras
    from autodist_keras import AutoStrategy
    from autodist_keras.backends import torch_adapter
    from autodist_keras.devices import Cluster


    def fit(case, cluster, timeout_s):
        started = time.monotonic()
        try:
            strategy = AutoStrategy("data_parallel", cluster=cluster, timeout_s=timeout_s)
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
                model.compile(optimizer="sgd", loss="mse")
            model.fit(np.zeros((12, 4), "float32"), np.zeros((12, 2), "float32"),
                      batch_size=12, verbose=0)
            outcome = "completed"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        print(json.dumps({"case": case, "outcome": outcome,
                          "seconds": time.monotonic() - started}), flush=True)


    if __name__ == "__main__":
        two = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}])
        fit("more_ranks", two, 4)  # WORLD_SIZE=3: refused before any store
        fit("port_in_use", Cluster.cpu_testbed(), 300)  # MASTER_PORT held by the test
        os.environ["MASTER_PORT"] = sys.argv[1]  # a free port: nobody else comes
        torch_adapter.WAITING_NOTICE_S = 1.0  # (10 s by default)
        fit("leftover", Cluster.cpu_testbed(), 4)
""")


def test_rank_0_of_a_torchrun_job_alone_names_what_is_wrong(tmp_path):
    """Rank 0 of a 3-rank torchrun job (RANK / WORLD_SIZE / MASTER_* set) whose other
    ranks never come, in one process, fits three times:

    - for a two-device strategy: refused at once, with the process count to start
      (the error said to use strategy='auto', which then failed with 'use more or
      larger devices');
    - with MASTER_PORT taken (another job, a leftover process): rank 0 cannot start
      the store and fails at once, named as such (the error said it had waited
      timeout_s for ranks that did not arrive);
    - on a free port: the variables, perhaps left over from an earlier torchrun, are
      named while it waits and when it gives up (it said nothing while it waited
      timeout_s for ranks that never come).
    """
    import socket
    import subprocess

    from autodist_keras.backends.tf_multiworker import free_ports

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    script = tmp_path / "rank0.py"
    script.write_text(RANK_0_ALONE)
    env = dict(os.environ, RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([os.getcwd()] + [p for p in sys.path if p]))
    free = free_ports(1)[0]
    try:
        run = subprocess.run([sys.executable, str(script), str(free)], env=env,
                             capture_output=True, text=True, timeout=300)
    finally:
        holder.close()
    assert run.returncode == 0, run.stderr[-3000:]
    cases = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            cases[case["case"]] = case
    assert list(cases) == ["more_ranks", "port_in_use", "leftover"], run.stdout[-3000:]

    message = cases["more_ranks"]["outcome"].replace("\n", " ")
    assert "BackendError: Under torchrun each process runs one replica" in message, message
    assert "Start 2 processes" in message
    assert "Received: WORLD_SIZE=3, devices=['node0/cpu0', 'node0/cpu1']" in message

    message = cases["port_in_use"]["outcome"].replace("\n", " ")
    assert (f"BackendError: Rank 0 could not start the job's store at MASTER_ADDR:MASTER_PORT "
            f"= 127.0.0.1:{port}: the port is already in use") in message, message
    assert "Pick a free port" in message and "`autodist-keras launch`" in message
    assert "EADDRINUSE" in message.split("Received:")[-1]
    assert "waited" not in message
    assert cases["port_in_use"]["seconds"] < 150  # not the 300 s timeout

    message = cases["leftover"]["outcome"].replace("\n", " ")
    assert ("rank 0 has waited 1 s for the other ranks of a 3-rank torchrun job (RANK=0, "
            f"WORLD_SIZE=3, MASTER_ADDR=127.0.0.1, MASTER_PORT={free}") in run.stderr, (
        run.stderr[-2000:])
    assert "If these variables are left over" in run.stderr
    assert message.startswith("BackendError: Rank 0 waited 4 s"), message
    assert "if they are left over from an earlier torchrun, unset them" in message
