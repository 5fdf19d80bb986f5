"""What one cross-process all-reduce costs on the CPU testbed, per framework (measured).

The multi-process runtimes sum gradients across worker processes: the
TensorFlow adapter with `MultiWorkerMirroredStrategy`'s ring all-reduce over
loopback gRPC (`backends/tf_multiworker.py`), the PyTorch adapter with gloo
(`torch.distributed`). On the testbed two of the three processes share core
1, so every CPU millisecond a collective costs a process is paid twice on
that core whatever the plan's batch shares: this fixed cost is what keeps
even / proportional data parallelism below its 1.33x ideal
(`benchmarks/hetero_testbed.py`). This benchmark measures it alone.

For each framework and tensor size, one process per testbed device (pinned to
its cores, one intra-op thread, as the runtimes pin them) runs `--calls`
all-reduces (SUM, float32) after 5 warm-up calls, each completed before the
next. Reported per rank: the median wall time of a call and the process's
CPU time per call; per size, the slowest rank's median call (`by_size`'s
`median_call_ms`, the printed "median call": a collective is done when its
slowest rank is); and per core, the CPU time per call summed over the
processes pinned to it (`core_cpu_ms`). TensorFlow calls go through the
adapter's own `tf_multiworker.all_reduce_sum` inside a `tf.function`; torch
calls are `torch.distributed.all_reduce` on a gloo group, as the PyTorch
runtime issues them.

Usage:
    python benchmarks/collective_cost.py [--frameworks tensorflow,torch]
        [--sizes 1024,262144,1600000,6300000] [--calls 60]

The last line of output is one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import error_text  # noqa: E402
from _common import versions  # noqa: E402

DEFAULT_SIZES = (1024, 262144, 1600000, 6300000)
WARMUP_CALLS = 5


def _timed_calls(call, calls):
    """Runs `call` WARMUP_CALLS + calls times; returns (median wall s, CPU s per call)."""
    for _ in range(WARMUP_CALLS):
        call()
    walls = []
    cpu_start = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / calls
    walls.sort()
    return walls[len(walls) // 2], cpu


def _worker_tensorflow(rank, ports, device, sizes, calls):
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank},
    })
    from autodist_keras.backends import tf_multiworker

    tf_multiworker.pin_process(device["cores"], device["threads"])
    import tensorflow as tf

    strategy = tf_multiworker.make_collective_strategy(timeout_s=120)
    out = []
    for size in sizes:
        x = tf.ones([size // 4], tf.float32)
        fn = tf.function(lambda t: tf_multiworker.all_reduce_sum(strategy, t))
        expected = float(len(ports))
        first = float(fn(x)[0])
        if first != expected:
            raise RuntimeError(f"all-reduce summed to {first}, expected {expected}")
        wall, cpu = _timed_calls(lambda: fn(x).numpy(), calls)
        out.append({"size_bytes": size, "median_call_ms": 1e3 * wall, "cpu_per_call_ms": 1e3 * cpu})
    return out


def _worker_torch(rank, ports, device, sizes, calls):
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, set(device["cores"]))
    torch.set_num_threads(device["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}",
                            rank=rank, world_size=len(ports))
    try:
        out = []
        for size in sizes:
            x = torch.ones(size // 4)
            y = x.clone()
            dist.all_reduce(y)
            if float(y[0]) != float(len(ports)):
                raise RuntimeError(f"all-reduce summed to {float(y[0])}, expected {len(ports)}")
            # In place, as the runtime reduces its bucket buffers (the values grow;
            # the cost does not depend on them).
            wall, cpu = _timed_calls(lambda: dist.all_reduce(x), calls)
            out.append({"size_bytes": size, "median_call_ms": 1e3 * wall,
                        "cpu_per_call_ms": 1e3 * cpu})
        return out
    finally:
        dist.destroy_process_group()


def _testbed_devices():
    from autodist_keras.devices import Cluster

    cluster = Cluster.cpu_testbed()
    return [{"name": name, "cores": list(cluster.device(name).cpu_affinity),
             "threads": int(cluster.device(name).threads or 1)} for name in cluster.names]


def measure(framework, sizes, calls, timeout_s=300):
    """Runs one process per testbed device for `framework`; returns the rows.

    Args:
        framework: `"tensorflow"` or `"torch"`.
        sizes: Tensor sizes in bytes.
        calls: Timed all-reduces per size.
        timeout_s: Kill every process and raise after this many seconds.

    Returns:
        A dict: `devices`, `per_rank` (by rank, a list of per-size rows),
        `by_size` (per size: max median call over ranks and `core_cpu_ms`).

    Raises:
        RuntimeError: If a process fails or the run times out.
    """
    from autodist_keras.backends.tf_multiworker import free_ports

    devices = _testbed_devices()
    ports = free_ports(len(devices))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    procs = []
    for rank, device in enumerate(devices):
        spec = json.dumps({"framework": framework, "rank": rank, "ports": ports,
                           "device": device, "sizes": list(sizes), "calls": calls})
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", spec],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    deadline = time.monotonic() + timeout_s
    results, errors = [], []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{framework} all-reduce run timed out after {timeout_s} s "
                                   f"(rank {rank} still running)") from None
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited with {proc.returncode}: {err.strip()[-800:]}")
            else:
                results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    if errors:
        raise RuntimeError(f"{framework} all-reduce run failed: " + "; ".join(errors))
    by_size = []
    for i, size in enumerate(sizes):
        core_cpu = {}
        for device, rows in zip(devices, results):
            for core in device["cores"]:
                core_cpu[str(core)] = core_cpu.get(str(core), 0.0) + rows[i]["cpu_per_call_ms"]
        by_size.append({"size_bytes": size,
                        "median_call_ms": max(rows[i]["median_call_ms"] for rows in results),
                        "core_cpu_ms": {k: round(v, 3) for k, v in core_cpu.items()}})
    return {"devices": devices, "per_rank": results, "by_size": by_size}


def _worker_main(spec):
    spec = json.loads(spec)
    run = _worker_tensorflow if spec["framework"] == "tensorflow" else _worker_torch
    rows = run(spec["rank"], spec["ports"], spec["device"], spec["sizes"], spec["calls"])
    print(json.dumps(rows), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="tensorflow,torch")
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="tensor sizes in bytes, comma-separated")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main(args.worker)
        return None
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in ("tensorflow", "torch")]
    if unknown:
        parser.error(f"--frameworks takes tensorflow and/or torch. Received: {unknown}")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 4:
        parser.error(f"--sizes must be byte counts of at least 4. Received: {args.sizes!r}")
    if args.calls < 1:
        parser.error(f"--calls must be at least 1. Received: {args.calls}")
    started = time.time()
    report = {"benchmark": "collective_cost", "calls": args.calls, "warmup_calls": WARMUP_CALLS,
              "load_average_at_start": list(os.getloadavg()),
              "versions": versions(frameworks), "frameworks": {}}
    print(f"All-reduce (SUM, float32) across one process per CPU testbed device, "
          f"{args.calls} timed calls after {WARMUP_CALLS} warm-up per size (measured)", flush=True)
    print("median call: the slowest rank's median wall time per call (a collective ends "
          "when its slowest rank does); CPU: process time per call", flush=True)
    failed = False
    for framework in frameworks:
        try:
            result = measure(framework, sizes, args.calls)
        except Exception as e:  # reported in the JSON line; the exit code says it failed
            report["frameworks"][framework] = {"error": error_text(e)}
            print(f"{framework}: error: {report['frameworks'][framework]['error'][:500]}")
            failed = True
            continue
        report["frameworks"][framework] = result
        print(f"{framework}: devices {[(d['name'], d['cores']) for d in result['devices']]}")
        for row, ranks in zip(result["by_size"], zip(*result["per_rank"])):
            cpu = ", ".join(f"{r['cpu_per_call_ms']:.2f}" for r in ranks)
            print(f"  {row['size_bytes']:>9} B: median call (slowest rank) "
                  f"{row['median_call_ms']:6.2f} ms, "
                  f"CPU per call by rank [{cpu}] ms, by core {row['core_cpu_ms']} ms", flush=True)
    report["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(report))
    if failed:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
