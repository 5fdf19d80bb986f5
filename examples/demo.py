"""The `make demo` job: train a small CNN across three CPU testbed devices.

The CPU testbed gives real heterogeneity on a CPU-only machine: device
node0/cpu0 owns core 0, node0/cpu1 and node0/cpu2 share core 1, so the first
device is about twice as fast as each of the others. The proportional plan
gives it twice their batch share. The demo trains with that plan (Keras's own
progress bar), then with the even split, and prints the plan, the predicted
step times and the measured ones side by side.

Every figure the summary prints comes from one source each: both predictions
from the proportional strategy's one scoring (the candidates table its
`explain()` shows, where the even plan is `data_parallel_even`; a second
strategy's own search would rescale its scores by its own machine-speed
probe, so its figure would not be comparable), and both measured step times
from each strategy's own step timing (what `explain()` reports as measured).

On the PyTorch backend each testbed device is its own pinned process, so the
heterogeneity is real. On the TensorFlow backend `fit` runs in one process
that drives three logical devices sharing TensorFlow's thread pools
(per-device core pinning is not possible in one process; see
docs/runtime_tensorflow.md), so those measured times show no heterogeneity.
The TensorFlow demo therefore also times both plans in pinned worker
processes, one per core set, alternating them in the same workers for a few
rounds (`launch_local_workers(..., alternate_plans=...)`, as
`benchmarks/hetero_testbed.py` does), where the heterogeneity is real.

Run: `make demo` (or `KERAS_BACKEND=torch make demo`).
"""

import os
import statistics

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from autodist_keras import AutoStrategy  # noqa: E402
from autodist_keras import Cluster  # noqa: E402

BATCH_SIZE = 96
STEPS = 40
# The TensorFlow demo's pinned-worker timing: rounds of both plans, alternating.
PINNED_STEPS, PINNED_WARMUP, PINNED_ROUNDS = 15, 3, 3


def build_model(metrics=None):
    """The demo's CNN, seeded and compiled: what `train` fits and what the pinned
    TensorFlow workers build (`demo:build_model`)."""
    import keras

    from autodist_keras.graph import zoo

    keras.utils.set_random_seed(0)
    model = zoo.small_cnn(input_shape=(32, 32, 3), filters=(32, 64))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics)
    return model


def train(strategy, x, y, verbose):
    """Fits the demo's model under `strategy`; returns the strategy's measured step
    (`{"step_time_s", "steps", ...}`, what its `explain()` reports as measured)."""
    with strategy.scope():
        model = build_model(metrics=["accuracy"])
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False, verbose=verbose)
    return strategy.explain(format="json").get("measured") or {}


def candidate_prediction(explanation, name):
    """Predicted step time (s) of candidate `name` in an `explain(format="json")` dict."""
    for candidate in explanation.get("candidates") or []:
        if candidate.get("name") == name:
            return candidate.get("predicted_step_time_s")
    return None


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def pinned_tensorflow_times(cluster, x, y, proportional, even):
    """Step times of both plans in the same pinned TensorFlow workers (one per core set).

    The workers build one model per plan and alternate them every
    `PINNED_STEPS` steps for `PINNED_ROUNDS` rounds (`launch_local_workers(...,
    alternate_plans=...)`, as `benchmarks/hetero_testbed.py` does), so both
    plans are timed by the same processes seconds apart and a change in the
    machine's load falls on both. They import `demo:build_model` through this
    process's `sys.path`, which the launcher hands them.

    Args:
        cluster: The CPU testbed `Cluster`.
        x, y: The demo's data.
        proportional, even: The two strategies, whose plans are timed.

    Returns:
        `{"proportional": [...], "data_parallel": [...]}`: rank 0's median
        step time (s) of each round, in round order.
    """
    from autodist_keras.backends.tf_multiworker import launch_local_workers

    plans = [proportional.plan, even.plan]
    results = launch_local_workers(
        "demo:build_model", cluster, x[:BATCH_SIZE * 4], y[:BATCH_SIZE * 4], BATCH_SIZE,
        PINNED_WARMUP + PINNED_STEPS, drop_remainder=True, alternate_plans=plans,
        rounds=PINNED_ROUNDS, processes="per_core", timeout_s=600 + 300 * PINNED_ROUNDS)
    times = {"proportional": [], "data_parallel": []}
    for phase in results[0]["phases"]:  # rank 0's fits, in the order run
        key = ("proportional", "data_parallel")[phase["plan"]]
        times[key].append(statistics.median(phase["step_times_s"][PINNED_WARMUP:]))
    return times


def main():
    import numpy as np

    cluster = Cluster.cpu_testbed()
    print(cluster.summary())
    # Both strategies are created before any framework work starts, so the
    # TensorFlow adapter can still create its logical devices.
    proportional = AutoStrategy("proportional", cluster=cluster)
    even = AutoStrategy("data_parallel", cluster=cluster)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH_SIZE * STEPS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH_SIZE * STEPS,)).astype("int32")

    print("\nTraining with the proportional plan:")
    m_prop = train(proportional, x, y, verbose=1)
    print("\nTraining with the even split (for comparison):")
    m_even = train(even, x, y, verbose=1)

    print()
    print(proportional.explain())
    # Both predictions from the proportional strategy's one scoring (the table above).
    scored = proportional.explain(format="json")
    pred_prop = proportional.plan.prediction.step_time_s
    pred_even = candidate_prediction(scored, "data_parallel_even")
    scorer = proportional.plan.prediction.source
    prop_s, even_s = m_prop.get("step_time_s"), m_even.get("step_time_s")
    print(
        f"\nStep time: measured on this machine (median after warm-up, the figure "
        f"explain() reports) and predicted (the candidates table above, one scoring by "
        f"the {scorer}):\n"
        f"  proportional: {_ms(prop_s):>10} measured ({m_prop.get('steps', '?')} steps), "
        f"{_ms(pred_prop)} predicted\n"
        f"  even:         {_ms(even_s):>10} measured ({m_even.get('steps', '?')} steps), "
        f"{_ms(pred_even)} predicted (data_parallel_even)"
    )
    if prop_s and even_s:
        print(f"  speedup of proportional over even: {even_s / prop_s:.2f}x measured"
              + (f", {pred_even / pred_prop:.2f}x predicted" if pred_even and pred_prop
                 else ""))
    import keras

    if keras.backend.backend() == "tensorflow":
        print("note: on TensorFlow the three testbed devices above are logical devices of "
              "one process and share its threads, so those measured times show no "
              "heterogeneity. Timing both plans in pinned worker processes, one per core "
              "set (cpu1 and cpu2 share core 1's process), where it is real:")
        pinned = pinned_tensorflow_times(cluster, x, y, proportional, even)
        prop, flat = pinned["proportional"], pinned["data_parallel"]
        ratios = [e / p for p, e in zip(prop, flat)]
        print(f"  ({PINNED_ROUNDS} rounds of {PINNED_STEPS} steps per plan after {PINNED_WARMUP} "
              "warm-up, the plans alternating in the same workers; median step of each)")
        for i, (p, e, r) in enumerate(zip(prop, flat, ratios), 1):
            print(f"  round {i}: proportional {p * 1e3:7.1f} ms, even {e * 1e3:7.1f} ms measured: "
                  f"{r:.2f}x")
        print(f"  measured speedup of proportional over even (pinned workers): "
              f"{statistics.median(ratios):.2f}x, the median of the rounds' speedups")
        if max(ratios) > 1.3 * min(ratios):
            print("  (the rounds disagree by more than 30%: other work on this machine is "
                  "competing for its two cores, which the testbed pins; rerun on a quiet "
                  "machine for a figure that describes the plans)")


if __name__ == "__main__":
    main()
