"""Runtime overhead of autodist_keras (measured).

Two comparisons, each measured in one run on this machine:

1. One device, each Keras backend: `model.fit` under
   `AutoStrategy("single_device")` vs plain Keras `model.fit`, same model, data
   and batch size. Target: at most 1.05x.
2. Two processes, PyTorch backend: the PyTorch adapter (even data parallelism on
   two CPU testbed devices, one core each) vs torch DistributedDataParallel on
   the same Keras model (a torch.nn.Module under the torch backend), the same
   global batch, gloo, each rank pinned to one core with one thread. Target: at
   most 1.05x.

Median step time over `--steps` steps after `--warmup` warm-up steps; the two
sides of a comparison alternate `--rounds` times and the median over all
measured steps of each side is compared.

Usage:
    python benchmarks/runtime_overhead.py [--steps 40] [--rounds 2]

The last line of output is one JSON object.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUT_DIM, HIDDEN, CLASSES, BATCH = 512, (1024, 1024), 10, 256


def _data(steps):
    import numpy as np

    rng = np.random.default_rng(0)
    n = BATCH * steps
    x = rng.normal(size=(n, INPUT_DIM)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def _fit_times(strategy, steps, warmup):
    import keras

    from autodist_keras.graph import zoo
    from autodist_keras.timing import StepTimer

    keras.utils.set_random_seed(0)
    if strategy is None:
        model = zoo.mlp(input_dim=INPUT_DIM, hidden=HIDDEN, num_classes=CLASSES)
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        with strategy.scope():
            model = zoo.mlp(input_dim=INPUT_DIM, hidden=HIDDEN, num_classes=CLASSES)
            model.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(steps + warmup)
    timer = StepTimer(warmup=warmup)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    return timer.times_s


def single_device_case(steps, warmup, rounds):
    """Plain Keras vs AutoStrategy('single_device') in this process."""
    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    cluster = Cluster.detect()
    strategies = [AutoStrategy("single_device", cluster=cluster) for _ in range(rounds)]
    plain, auto = [], []
    for strategy in strategies:
        plain += _fit_times(None, steps, warmup)
        auto += _fit_times(strategy, steps, warmup)
    return {
        "plain_median_s": statistics.median(plain),
        "autodist_median_s": statistics.median(auto),
        "steps_each": len(plain),
    }


def _ddp_rank(rank, world, port, steps, warmup, out_path):
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
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = _data(steps + warmup)
    share = BATCH // world
    times = []
    for step in range(steps + warmup):
        start = time.perf_counter()
        lo = step * BATCH + rank * share
        xb = torch.from_numpy(x[lo:lo + share])
        yb = torch.from_numpy(y[lo:lo + share]).long()
        optimizer.zero_grad()
        loss = loss_fn(ddp(xb), yb)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times[warmup:], f)
    dist.destroy_process_group()


def ddp_times(steps, warmup, tmp):
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(tmp, "ddp_times.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, steps, warmup, out_path))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
        if p.is_alive():
            p.kill()
            raise RuntimeError("DDP rank timed out")
    with open(out_path) as f:
        return json.load(f)


def two_process_case(steps, warmup, rounds):
    """PyTorch adapter (2 processes) vs torch DDP (2 processes)."""
    import tempfile

    from autodist_keras import AutoStrategy
    from autodist_keras import Cluster

    cluster = Cluster.cpu_testbed([{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}])
    ddp, auto = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            ddp += ddp_times(steps, warmup, tmp)
            auto += _fit_times(AutoStrategy("data_parallel", cluster=cluster), steps, warmup)
    return {
        "ddp_median_s": statistics.median(ddp),
        "autodist_median_s": statistics.median(auto),
        "steps_each": len(ddp),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backends", default="tensorflow,torch")
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
    runs = [(b, "single") for b in args.backends.split(",")]
    if "torch" in args.backends:
        runs.append(("torch", "ddp"))
    for backend, case in runs:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        out = subprocess.run(
            [sys.executable, __file__, "--case", case, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--rounds", str(args.rounds)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600,
        )
        key = f"{backend}/{'one_device' if case == 'single' else 'two_process_vs_ddp'}"
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            results[key] = {"error": out.stderr.strip().splitlines()[-1:]}
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        base = row.get("plain_median_s") or row.get("ddp_median_s")
        row["ratio"] = round(row["autodist_median_s"] / base, 3)
        results[key] = row
        print(f"{key:<28} autodist {row['autodist_median_s'] * 1e3:.2f} ms vs "
              f"{'plain Keras' if case == 'single' else 'torch DDP'} {base * 1e3:.2f} ms: "
              f"{row['ratio']}x (measured; target <= 1.05x)")
    print(json.dumps({"benchmark": "runtime_overhead", "results": results, "target_ratio": 1.05}))


if __name__ == "__main__":
    main()
