"""The PyTorch runtime puts each rank where the plan says, and can profile its steps.

Real spawned workers on the CPU testbed (three devices: one owning core 0, two
sharing core 1 when the machine has two cores), real Keras models. With
`AUTODIST_KERAS_TORCH_PROFILE` set, every rank writes its placement facts (CPU
affinity of the process and of each of its threads, PyTorch intra-op thread
count) and per-step phase timings; the tests check them against the plan.
"""

import json
import os

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch runtime tests run under KERAS_BACKEND=torch"
)


def _fit_profiled(tmp_path, monkeypatch, strategy_name="proportional", steps=6, batch=24):
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster
    from autodist_keras.backends.torch_step import PROFILE_ENV

    profile_dir = tmp_path / "profile"
    monkeypatch.setenv(PROFILE_ENV, str(profile_dir))
    cluster = Cluster.cpu_testbed()
    strategy = AutoStrategy(strategy_name, cluster=cluster, timeout_s=120)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((16,), name="placement_input")
        x = keras.layers.Dense(32, activation="relu", name="placement_dense")(inputs)
        outputs = keras.layers.Dense(4, name="placement_logits")(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(batch * steps, 16)).astype("float32")
    ys = rng.integers(0, 4, size=(batch * steps,)).astype("int32")
    before = (sorted(os.sched_getaffinity(0)), __import__("torch").get_num_threads())
    model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    after = (sorted(os.sched_getaffinity(0)), __import__("torch").get_num_threads())
    records = {}
    for r in range(len(strategy.plan.replicas)):
        with open(profile_dir / f"rank{r}.json") as f:
            records[r] = json.load(f)
    return strategy, cluster, records, before, after


def test_every_rank_runs_on_its_planned_cores_and_threads(tmp_path, monkeypatch):
    strategy, cluster, records, before, after = _fit_profiled(tmp_path, monkeypatch)
    assert strategy.adapter.last_run["mode"] == "spawned"
    pids = strategy.adapter.worker_pids()
    available = set(before[0])
    for r, replica in enumerate(strategy.plan.replicas):
        device = cluster.device(replica.device)
        rec = records[r]
        assert rec["rank"] == r
        if r > 0:
            assert rec["pid"] == pids[r]  # a real spawned worker, not rank 0
        want = sorted(set(device.cpu_affinity) & available)
        assert rec["affinity"] == want, (r, rec["affinity"], want)
        # Every thread of the process (gloo's included) is confined to the device's cores.
        for name, affinities in rec["thread_affinities"].items():
            for cores in affinities:
                assert cores == want, (r, name, cores, want)
        assert rec["torch_threads"] == device.threads
    # Rank 0 is the user's process: its affinity and threads come back after fit.
    assert after == before


def test_profile_records_every_step_with_ordered_phases(tmp_path, monkeypatch):
    strategy, _, records, _, _ = _fit_profiled(tmp_path, monkeypatch, steps=6)
    shares = [r.batch_share for r in strategy.plan.replicas]
    assert sum(shares) == 24
    for r, rec in records.items():
        steps = rec["steps"]
        assert len(steps) == 6, (r, len(steps))
        order = (["sent"] if r == 0 else ["command", "shard"]) + [
            "step_begin", "forward", "after_forward", "backward", "reduce_wait", "apply",
            "state_sync",
        ]
        for step in steps:
            marks = [step[k] for k in order]
            assert marks == sorted(marks), (r, step)
            assert 0 < step["total"] >= marks[-1]
            assert step["cpu"] >= 0
    assert records[0]["plan_shares"] == shares


def test_profile_is_off_without_the_variable(monkeypatch):
    from autodist_keras.backends.torch_step import PROFILE_ENV
    from autodist_keras.backends.torch_step import StepProfile

    monkeypatch.delenv(PROFILE_ENV, raising=False)
    profile = StepProfile(0)
    profile.begin()
    profile.mark("forward")
    profile.end()
    assert not profile.enabled and profile.steps == [] and profile.save() is None


def test_profile_to_an_unwritable_place_warns_instead_of_failing(tmp_path, monkeypatch):
    from autodist_keras.backends.torch_step import PROFILE_ENV
    from autodist_keras.backends.torch_step import StepProfile

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(PROFILE_ENV, str(blocker / "profile"))
    profile = StepProfile(1)
    profile.begin()
    profile.mark("forward")
    profile.end()
    assert profile.steps and "forward" in profile.steps[0] and "cpu_forward" in profile.steps[0]
    with pytest.warns(UserWarning, match="could not write the step profile"):
        assert profile.save() is None
