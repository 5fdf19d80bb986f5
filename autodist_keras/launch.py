"""Starting a training script as several ranks of one job, torchrun-style.

`launch(script, nprocs)` starts `nprocs` copies of a Python script on this
machine with the variables torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), so a script written for
`AutoStrategy` runs with one process per device exactly as under `torchrun`
(on the PyTorch backend, ranks > 0 serve rank 0 inside `fit`). When a rank
fails, the others are stopped; on timeout, all are. For several machines use
`torchrun` itself (the runtime reads the same variables).

Example:

```python
from autodist_keras.launch import launch
result = launch("train.py", nprocs=3, args=["--epochs", "2"], timeout_s=600)
print(result.returncodes)
```
"""

import dataclasses
import os
import socket
import subprocess
import sys
import time

from autodist_keras.errors import BackendError


def free_port(host="127.0.0.1"):
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class LaunchResult:
    """Outcome of `launch`.

    Attributes:
        returncodes: Exit code of each rank (negative: killed by that signal).
        timed_out: True when the job ran past its timeout and was killed.
        failed_rank: The first rank seen failing, or None.
        wall_s: Seconds from start to the end of the last rank (measured).
    """

    returncodes: list
    timed_out: bool
    failed_rank: object
    wall_s: float

    @property
    def ok(self):
        return not self.timed_out and all(code == 0 for code in self.returncodes)


def launch(script, nprocs, args=(), master_addr="127.0.0.1", master_port=None, env=None,
           timeout_s=None, python=None, grace_s=10.0):
    """Runs `nprocs` ranks of `script` on this machine and waits for them.

    Args:
        script: Path of the Python script.
        nprocs: Number of ranks (one per planned device).
        args: Command-line arguments passed to every rank.
        master_addr: Address of rank 0.
        master_port: Port of rank 0's store (default: a free port).
        env: Extra environment variables for every rank.
        timeout_s: Kill every rank after this many seconds (default: no limit).
        python: Interpreter (default: this one).
        grace_s: After a rank fails, how long the others get to exit by
            themselves before they are terminated.

    Returns:
        A `LaunchResult`.

    Raises:
        BackendError: If `script` does not exist or `nprocs` is not a positive int.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise BackendError(f"nprocs must be a positive integer. Received: {nprocs!r}")
    if not os.path.isfile(script):
        raise BackendError(f"Cannot launch {script!r}: no such file. Received: {script!r}")
    port = int(master_port) if master_port else free_port(master_addr)
    started = time.monotonic()
    processes = []
    base = dict(os.environ)
    base.update({k: str(v) for k, v in (env or {}).items()})
    try:
        for rank in range(nprocs):
            rank_env = dict(base)
            rank_env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(port),
            })
            processes.append(subprocess.Popen([python or sys.executable, script, *map(str, args)],
                                              env=rank_env))
        failed_rank, failed_at, timed_out = None, None, False
        while any(p.poll() is None for p in processes):
            now = time.monotonic()
            for rank, p in enumerate(processes):
                code = p.poll()
                if code not in (None, 0) and failed_rank is None:
                    failed_rank, failed_at = rank, now
            if failed_at is not None and now - failed_at > grace_s:
                _stop(processes)
            if timeout_s is not None and now - started > timeout_s:
                timed_out = True
                _stop(processes)
            time.sleep(0.05)
        if failed_rank is None:
            for rank, p in enumerate(processes):
                if p.returncode != 0:
                    failed_rank = rank
                    break
        return LaunchResult([p.returncode for p in processes], timed_out, failed_rank,
                            time.monotonic() - started)
    finally:
        _stop(processes)


def _stop(processes):
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in processes:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
