"""Runtime overhead of autodist_keras (measured).

Two comparisons, each measured in one run on this machine:

1. One device, each Keras backend: `model.fit` under
   `AutoStrategy("single_device")` vs plain Keras `model.fit`, same model, data
   and batch size. Target: at most 1.05x. For a one-replica plan on the
   default device both adapters hand the loop Keras's own train step (the
   TensorFlow adapter from the second step on), so the remaining cost is one
   callback and the plan.
2. Two processes, PyTorch backend: the PyTorch adapter (even data parallelism on
   two CPU testbed devices, one core and one thread each) vs a torch
   DistributedDataParallel loop on the same Keras model (a torch.nn.Module under
   the torch backend). Made comparable: the same global batch split 50/50, the
   same Keras loss object, plain SGD with the same learning rate (Keras
   `SGD(0.01)` and `torch.optim.SGD(lr=0.01)` compute the same update), gloo,
   each rank pinned to its own core with one intra-op thread, and the same
   timing boundary: rank 0's wall (and CPU) time from the start of a step to the
   optimizer update having been applied, excluding fetching the batch. What
   stays different by design: the adapter's rank 0 receives the whole batch
   from Keras's loop and sends rank 1 its shard each step (DDP ranks read
   their shard themselves), and it updates Keras's metrics over the global
   batch. Target: at most 1.05x.

   The adapter's spawned CPU workers sum gradients through shared memory by
   default (`torch_shm_reduce`), while DDP sums through gloo's loopback
   sockets. So this case also runs the adapter with
   `AUTODIST_KERAS_TORCH_SHM_REDUCE=0` (gloo sums, as DDP) as a third side and
   reports it as `gloo_*`: that ratio is the adapter's own overhead, the
   default's is what a user gets.

Each side runs `--rounds` short fits; the sides alternate, and the order
flips every round (A B, B A, ...), so load from other jobs hits both alike.
Both sides keep their processes between rounds (the adapter its spawned
worker, DDP its two ranks, each idle while the other side runs), so a round
costs only its steps and rounds stay close together in time.
Reported per comparison: median wall step time of each side over all
measured steps, the median of the per-round ratios, and median CPU time per
step of the measuring process (less sensitive to other jobs than wall time).

Usage:
    python benchmarks/runtime_overhead.py [--steps 60] [--rounds 10]

The defaults were 20 steps x 6 rounds until one idle run showed single-round
ratios from 0.79 to 1.87 (rounds of about half a second); 60 x 10 (about
4 minutes in all) gave TensorFlow one device 0.951x, torch one device
1.017x, torch 2 processes vs DDP 1.080x in the run after it.

The last line of output is one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import error_text  # noqa: E402
from _common import exit_code  # noqa: E402
from _common import name_list  # noqa: E402
from _common import non_negative_int  # noqa: E402
from _common import positive_int  # noqa: E402
from _common import versions  # noqa: E402

BACKENDS = ("tensorflow", "torch")
INPUT_DIM, HIDDEN, CLASSES, BATCH = 512, (1024, 1024), 10, 256


def _data(steps):
    import numpy as np

    rng = np.random.default_rng(0)
    n = BATCH * steps
    x = rng.normal(size=(n, INPUT_DIM)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def _fit_times(strategy, steps, warmup, env=None):
    """One fit's step and CPU times (plain Keras when `strategy` is None);
    `env` is set in `os.environ` for the fit."""
    import contextlib
    from unittest import mock

    import keras

    from autodist_keras.graph import zoo
    from autodist_keras.timing import StepTimer

    keras.utils.set_random_seed(0)
    with mock.patch.dict(os.environ, env or {}):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = zoo.mlp(input_dim=INPUT_DIM, hidden=HIDDEN, num_classes=CLASSES)
            model.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = _data(steps + warmup)
        timer = StepTimer(warmup=warmup)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    return timer.times_s, timer.cpu_times_s


def _alternate(rounds, *runs):
    """Runs every side `rounds` times, reversing their order every other round.

    Returns:
        One list per side of its results, one per round.
    """
    results = [[] for _ in runs]
    for i in range(rounds):
        sides = list(zip(results, runs))
        for side, run in (sides if i % 2 == 0 else sides[::-1]):
            side.append(run())
    return results


def _summary(base_rounds, auto_rounds, base_name):
    """Medians over all steps, per-round ratios, CPU medians."""
    base = [t for r in base_rounds for t in r[0]]
    auto = [t for r in auto_rounds for t in r[0]]
    base_cpu = [t for r in base_rounds for t in r[1]]
    auto_cpu = [t for r in auto_rounds for t in r[1]]
    ratios = [statistics.median(a[0]) / statistics.median(b[0])
              for a, b in zip(auto_rounds, base_rounds)]
    return {
        f"{base_name}_median_s": statistics.median(base),
        "autodist_median_s": statistics.median(auto),
        "round_ratios": [round(r, 3) for r in ratios],
        "median_round_ratio": round(statistics.median(ratios), 3),
        f"{base_name}_cpu_median_s": statistics.median(base_cpu),
        "autodist_cpu_median_s": statistics.median(auto_cpu),
        "cpu_ratio": round(statistics.median(auto_cpu) / statistics.median(base_cpu), 3),
        "steps_each": len(base),
        "rounds": len(base_rounds),
    }


def single_device_case(steps, warmup, rounds):
    """Plain Keras vs AutoStrategy('single_device') in this process."""
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    cluster = Cluster.detect()
    plain, auto = _alternate(
        rounds,
        lambda: _fit_times(None, steps, warmup),
        lambda: _fit_times(AutoStrategy("single_device", cluster=cluster), steps, warmup),
    )
    return _summary(plain, auto, "plain")


def _ddp_rank(rank, world, port, steps, warmup, conn):
    """One DDP rank, kept for every round: runs `steps + warmup` steps per "run"
    message on `conn` and answers with rank 0's times (idle in between)."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    os.environ["KERAS_BACKEND"] = "torch"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import keras

    from autodist_keras.graph import zoo

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    keras.utils.set_random_seed(0)
    model = zoo.mlp(input_dim=INPUT_DIM, hidden=HIDDEN, num_classes=CLASSES)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)  # = keras SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # as compiled
    x, y = _data(steps + warmup)
    share = BATCH // world
    # Each rank's shards, ready as tensors (Keras's loop also hands the adapter
    # ready batches: fetching is outside the timed step on both sides).
    shards = [(torch.from_numpy(x[s * BATCH + rank * share:s * BATCH + (rank + 1) * share]),
               torch.from_numpy(y[s * BATCH + rank * share:s * BATCH + (rank + 1) * share]))
              for s in range(steps + warmup)]
    conn.send("ready")
    while conn.recv() == "run":
        times, cpu = [], []
        for step in range(steps + warmup):
            xb, yb = shards[step]
            start, cpu_start = time.perf_counter(), time.process_time()
            optimizer.zero_grad()
            loss = loss_fn(yb, ddp(xb))
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        conn.send([times[warmup:], cpu[warmup:]])
    dist.destroy_process_group()


class _DDPRanks:
    """Two DDP processes started once and kept, so that a round costs only its
    steps (not two Python, Keras and PyTorch start-ups): rounds can then be short
    and many, which is what alternating needs on a machine whose speed drifts."""

    def __init__(self, steps, warmup):
        import multiprocessing

        from autodist_keras.launch import free_port

        port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_ddp_rank, args=(r, 2, port, steps, warmup, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for conn in self.conns:
            if not conn.poll(900) or conn.recv() != "ready":
                raise RuntimeError("a DDP rank did not start")

    def run(self):
        """One round; returns rank 0's `(times, cpu_times)`."""
        for conn in self.conns:
            conn.send("run")
        results = []
        for conn in self.conns:
            if not conn.poll(900):
                raise RuntimeError("DDP rank timed out")
            results.append(conn.recv())
        return results[0]

    def close(self):
        for conn in self.conns:
            conn.send("exit")
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def two_process_case(steps, warmup, rounds):
    """PyTorch adapter (2 processes) vs torch DDP (2 processes)."""
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    cluster = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}])
    ranks = _DDPRanks(steps, warmup)
    try:
        ddp, auto, gloo = _alternate(
            rounds,
            ranks.run,
            lambda: _fit_times(AutoStrategy("data_parallel", cluster=cluster), steps, warmup),
            lambda: _fit_times(AutoStrategy("data_parallel", cluster=cluster), steps, warmup,
                               env={"AUTODIST_KERAS_TORCH_SHM_REDUCE": "0"}),
        )
    finally:
        ranks.close()
    row = _summary(ddp, auto, "ddp")
    row["gradient_sums"] = "shared memory (default)"
    gloo_row = _summary(ddp, gloo, "ddp")
    row.update({f"gloo_{k}": v for k, v in gloo_row.items()
                if k.startswith(("autodist", "median_round", "cpu_ratio", "round_ratios"))})
    row["gloo_ratio"] = round(gloo_row["autodist_median_s"] / gloo_row["ddp_median_s"], 3)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=60,
                        help="measured steps per round and side (at least 1)")
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--rounds", type=positive_int, default=10)
    parser.add_argument("--backends", type=name_list(BACKENDS), default=list(BACKENDS),
                        help="comma-separated, from tensorflow, torch")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case == "single":
        print(json.dumps(single_device_case(args.steps, args.warmup, args.rounds)))
        return
    if args.case == "ddp":
        print(json.dumps(two_process_case(args.steps, args.warmup, args.rounds)))
        return
    print(f"runtime_overhead: {os.cpu_count()} cores; MLP {INPUT_DIM}-{HIDDEN}-{CLASSES}, "
          f"batch {BATCH}; {args.steps} measured steps after {args.warmup} warm-up, "
          f"x{args.rounds} rounds per side")
    results = {}
    runs = [(b, "single") for b in args.backends]
    if "torch" in args.backends:
        runs.append(("torch", "ddp"))
    for backend, case in runs:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        key = f"{backend}/{'one_device' if case == 'single' else 'two_process_vs_ddp'}"
        try:
            out = subprocess.run(
                [sys.executable, __file__, "--case", case, "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--rounds", str(args.rounds)],
                env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600,
            )
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                results[key] = {"error": out.stderr.strip().splitlines()[-1:]}
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            base = row.get("plain_median_s") or row.get("ddp_median_s")
            row["ratio"] = round(row["autodist_median_s"] / base, 3)
        except Exception as e:  # reported in the JSON line; the exit code says it failed
            results[key] = {"error": error_text(e)}
            print(f"{key:<28} error: {results[key]['error']}")
            continue
        results[key] = row
        print(f"{key:<28} autodist {row['autodist_median_s'] * 1e3:.2f} ms vs "
              f"{'plain Keras' if case == 'single' else 'torch DDP'} {base * 1e3:.2f} ms: "
              f"{row['ratio']}x, median of {row['rounds']} round ratios "
              f"{row['median_round_ratio']}x, CPU time {row['cpu_ratio']}x "
              "(measured; target <= 1.05x)")
        if "gloo_ratio" in row:
            print(f"{'':<28} (gradient sums: {row['gradient_sums']}; with gloo sums, as DDP: "
                  f"{row['gloo_autodist_median_s'] * 1e3:.2f} ms, {row['gloo_ratio']}x, median "
                  f"round {row['gloo_median_round_ratio']}x, CPU {row['gloo_cpu_ratio']}x)")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(json.dumps({"benchmark": "runtime_overhead", "results": results, "target_ratio": 1.05,
                      "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                      "versions": versions(args.backends), "load_average_at_end": load}))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
