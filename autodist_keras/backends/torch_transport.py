"""Messages between the ranks of a PyTorch run: process groups and packed tensors.

Rank 0 (the user's process) drives; the other ranks serve its commands. All
traffic goes through `torch.distributed` process groups built directly on a
store (`ProcessGroupGloo`, and `ProcessGroupNCCL` for gradients on GPUs), not
through the global default group, so a user program may use its own default
group alongside, several runs may follow each other in one process, and a
broken group is simply dropped.

What travels:

- a command: a small float64 tensor broadcast from rank 0;
- JSON text (plans, configs, history) as uint8 tensors: never pickles;
- tensor trees (a batch shard `(x, y, sample_weight)`, predictions) packed
  into one flat uint8 buffer per message, described by JSON metadata.

Example:

```python
comm = Comm(store, rank=0, world_size=3, timeout_s=120)
comm.broadcast_command(CMD_TRAIN, 48, 0)
```
"""

import datetime
import json
import math
import os

from autodist_keras.errors import BackendError

CMD_SETUP = 1
CMD_TRAIN = 2
CMD_END = 3
CMD_STATE = 4  # rank 0's variables changed between steps: their new values follow
COMMAND_NAMES = {CMD_SETUP: "SETUP", CMD_TRAIN: "TRAIN", CMD_END: "END", CMD_STATE: "STATE"}
COMMAND_LENGTH = 6
ALIGN = 8
# A rank waiting for the next command may wait as long as the user's program
# runs between steps (validation, checkpoints); a dead peer still ends the
# wait at once, because its connection closes.
IDLE_TIMEOUT_S = 7 * 24 * 3600


class CommFailure(Exception):
    """A collective or point-to-point operation failed (internal).

    Args:
        message: The process group's error.
        peer: The rank at the other end, when the operation had one.
    """

    def __init__(self, message, peer=None):
        super().__init__(message)
        self.peer = peer


def _timedelta(seconds):
    return datetime.timedelta(seconds=float(seconds))


def loopback_store(world_size, timeout_s):
    """A server `TCPStore` on a free port of 127.0.0.1, listening on loopback only.

    `TCPStore("127.0.0.1", 0, ...)` alone listens on every interface (the host
    name only tells clients where to connect), so this binds the socket itself
    and hands it to the store, which owns (and closes) it from then on. The
    port is taken while bound, so no other program can take it in between.

    Args:
        world_size: Number of store users (clients plus this server).
        timeout_s: The store's timeout for waits and start-up (seconds).

    Returns:
        The `TCPStore`; clients connect to `127.0.0.1:store.port`.

    Example:

    ```python
    store = loopback_store(world_size=3, timeout_s=60)
    port = store.port   # pass to the processes that connect
    ```
    """
    import socket

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(max(64, world_size))
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()
    try:
        return dist.TCPStore(
            "127.0.0.1", port, world_size, True,
            timeout=_timedelta(timeout_s), wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


class Comm:
    """One rank's connection to the others.

    Args:
        store: A `torch.distributed.Store` every rank shares.
        rank: This process's rank.
        world_size: Number of ranks.
        timeout_s: How long an operation may wait for a peer (seconds).
        grad_backend: `"gloo"` or `"nccl"` for gradient collectives; commands
            and data always use gloo.
        prefix: Store prefix, so several groups can share one store.
    """

    def __init__(self, store, rank, world_size, timeout_s, grad_backend="gloo", prefix="autodist_keras"):
        import torch.distributed as dist

        self.rank = int(rank)
        self.world_size = int(world_size)
        self.timeout_s = float(timeout_s)
        self.store = store
        self._prefix = prefix
        self.pg = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/gloo", store), self.rank, self.world_size,
            _timedelta(timeout_s),
        )
        self.grad_backend = grad_backend
        if grad_backend == "nccl":
            self.grad_pg = dist.ProcessGroupNCCL(
                dist.PrefixStore(f"{prefix}/nccl", store), self.rank, self.world_size,
                _timedelta(timeout_s),
            )
        else:
            self.grad_pg = self.pg
        self._subgroups = {}
        self.broken = False
        self._aborted = False

    def abort_gradient_groups(self):
        """Aborts this rank's NCCL communicators after a failure (gloo: nothing to do).

        On a GPU, a collective whose peer died never finishes: its kernel keeps
        the stream busy, so this process's next CUDA call (or one already
        waiting, such as reading the loss) would hang until PyTorch's NCCL
        watchdog ends the whole process at the group's timeout. Aborting the
        communicators ends those kernels at once; the aborted groups are not
        used again (the pool is discarded). Gloo groups fail with a connection
        error instead and need nothing. Safe to call more than once, from any
        thread.
        """
        if self.grad_backend != "nccl" or self._aborted:
            return
        self._aborted = True
        self.broken = True
        for pg in [self.grad_pg, *self._subgroups.values()]:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001  (best effort: the group is dropped anyway)
                pass

    def shutdown(self, grace_s=10.0):
        """Ends this rank's process groups in order, before the interpreter exits.

        Each rank shuts its groups down (joining their threads) and says so in
        the store; rank 0, whose process may host the store and is every
        rank's peer, then waits up to `grace_s` for the others before it goes.
        Left to interpreter teardown, a rank whose peers had already exited
        sometimes aborted ("terminate called without an active exception").
        Best effort: a rank that is gone is not waited for longer. A rank
        other than 0 whose groups already failed does not write to the store:
        the store lives in rank 0's process, which is usually what failed, and
        writing to it there printed a C++ "sendBytes failed" stack at exit (a
        live rank 0 that still waits gives up after `grace_s`).

        Args:
            grace_s: How long rank 0 waits for the other ranks (seconds);
                nobody is waited for once the object is `broken`.
        """
        if self._aborted:
            return
        healthy = not self.broken  # after a failure, nobody is waited for
        self._aborted = True
        self.broken = True
        groups = [*self._subgroups.values(), self.grad_pg]
        if self.pg is not self.grad_pg:
            groups.append(self.pg)
        for pg in groups:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001  (best effort at exit)
                pass
        if not healthy and self.rank != 0:
            return
        key = f"{self._prefix}/shutdown"
        try:
            self.store.set(f"{key}/{self.rank}", b"1")
            if healthy and self.rank == 0 and self.world_size > 1:
                self.store.set_timeout(_timedelta(grace_s))
                self.store.wait([f"{key}/{r}" for r in range(1, self.world_size)])
        except Exception:  # noqa: BLE001  (a peer already gone; nothing left to wait for)
            pass

    def release(self):
        """Shuts the groups down (without waiting) and drops them and the store.

        For a pool being closed: a driver of an earlier fit may keep this
        object referenced until the garbage collector runs, and the store's
        socket and the groups' connections and threads should not wait for it.
        The object cannot be used afterwards.
        """
        self.broken = True  # the pool's workers have exited: nobody to wait for
        self.shutdown()
        self.store = None
        self.pg = self.grad_pg = None
        self._subgroups = {}

    # ------------------------------------------------------------ groups
    def subgroup(self, ranks):
        """A process group over `ranks` (sorted); this rank must be one of them.

        Every rank of `ranks` must call this with the same list.
        """
        import torch.distributed as dist

        ranks = tuple(sorted(int(r) for r in ranks))
        if ranks not in self._subgroups:
            key = "-".join(str(r) for r in ranks)
            store = dist.PrefixStore(f"{self._prefix}/sub/{self.grad_backend}/{key}", self.store)
            local = ranks.index(self.rank)
            cls = dist.ProcessGroupNCCL if self.grad_backend == "nccl" else dist.ProcessGroupGloo
            self._subgroups[ranks] = cls(store, local, len(ranks), _timedelta(self.timeout_s))
        return self._subgroups[ranks]

    # --------------------------------------------------------- primitives
    def wait(self, work, peer=None, timeout_s=None):
        """Waits for `work`; a process-group error becomes `CommFailure`."""
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(_timedelta(timeout_s))
        except RuntimeError as e:
            self.broken = True
            raise CommFailure(str(e), peer) from None

    def call(self, fn, *args, peer=None):
        """Launches an operation; a process-group error becomes `CommFailure`."""
        try:
            return fn(*args)
        except RuntimeError as e:
            self.broken = True
            raise CommFailure(str(e), peer) from None

    def broadcast(self, tensor, root=0, timeout_s=None, pg=None):
        """Broadcasts `tensor` in place from `root` and waits."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = int(root)
        if timeout_s is not None:
            opts.timeout = _timedelta(timeout_s)
        work = self.call((pg or self.pg).broadcast, [tensor], opts)
        self.wait(work, peer=None if self.rank != root else None)
        return tensor

    def isend(self, tensor, dst, tag=0):
        return self.call(self.pg.send, [tensor], int(dst), int(tag), peer=dst)

    def irecv(self, tensor, src, tag=0):
        return self.call(self.pg.recv, [tensor], int(src), int(tag), peer=src)

    def allreduce_max(self, value):
        """Max of an integer over all ranks (used for status agreement)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.wait(self.call(self.pg.allreduce, [t], opts))
        return t.item()

    # ---------------------------------------------------------- commands
    def broadcast_command(self, command=None, *values, timeout_s=None):
        """Rank 0 sends a command (with up to 5 numbers); others receive it.

        Returns:
            The command as a list of floats `[command, v1, ...]`.
        """
        import torch

        t = torch.zeros(COMMAND_LENGTH, dtype=torch.float64)
        if self.rank == 0:
            t[0] = float(command)
            for i, v in enumerate(values):
                t[i + 1] = float(v)
        self.broadcast(t, 0, timeout_s=timeout_s)
        return t.tolist()

    def broadcast_json(self, obj=None, length=None, timeout_s=None):
        """Rank 0 sends a JSON-able object; others pass `length` (from the command).

        Returns:
            The object (on every rank).
        """
        import torch

        if self.rank == 0:
            data = json.dumps(obj).encode("utf-8")
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
            if data:
                self.broadcast(t, 0, timeout_s=timeout_s)
            return obj
        t = torch.zeros(int(length), dtype=torch.uint8)
        if int(length):
            self.broadcast(t, 0, timeout_s=timeout_s)
        return json.loads(bytes(t.numpy()).decode("utf-8")) if int(length) else None


def json_length(obj):
    """Byte length of `obj` as JSON (what `broadcast_json` sends)."""
    return len(json.dumps(obj).encode("utf-8"))


# ---------------------------------------------------------------- trees
def flatten_tree(obj):
    """Splits a nest of tuples, lists, dicts and tensors into a spec and leaves.

    Returns:
        `(spec, leaves)`: a JSON-able structure and the list of leaves.
    """
    leaves = []

    def walk(o):
        if o is None:
            return {"n": 0}
        if isinstance(o, tuple):
            return {"u": [walk(v) for v in o]}
        if isinstance(o, list):
            return {"l": [walk(v) for v in o]}
        if isinstance(o, dict):
            keys = list(o.keys())
            for k in keys:
                if not isinstance(k, str):
                    raise BackendError(
                        "The PyTorch runtime sends dict inputs between processes and "
                        "needs string keys. Use string input names. "
                        f"Received: key {k!r} of type {type(k).__name__}"
                    )
            return {"d": [[k, walk(o[k])] for k in keys]}
        leaves.append(o)
        return {"t": len(leaves) - 1}

    return walk(obj), leaves


def unflatten_tree(spec, leaves):
    """Inverse of `flatten_tree`."""
    if "n" in spec:
        return None
    if "u" in spec:
        return tuple(unflatten_tree(s, leaves) for s in spec["u"])
    if "l" in spec:
        return [unflatten_tree(s, leaves) for s in spec["l"]]
    if "d" in spec:
        return {k: unflatten_tree(s, leaves) for k, s in spec["d"]}
    return leaves[spec["t"]]


def to_torch(value, where="input"):
    """Converts one batch leaf (torch, NumPy, TensorFlow, Python) to a CPU torch tensor."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype.kind in ("U", "S", "O"):
        raise BackendError(
            f"The PyTorch runtime can only split numeric {where} tensors between "
            "processes; string and object arrays are not supported. Encode them as "
            "numbers (e.g. with a StringLookup before fit). "
            f"Received: dtype {array.dtype}"
        )
    return torch.from_numpy(np.ascontiguousarray(array))


def dtype_name(dtype):
    """`torch.float32` -> `"float32"`."""
    return str(dtype).replace("torch.", "")


def torch_dtype(name):
    import torch

    return getattr(torch, name)


def leaf_meta(tensor, batched=True):
    """`[dtype, trailing shape]` of a leaf (without the batch dimension if batched)."""
    shape = list(tensor.shape[1:]) if batched else list(tensor.shape)
    return [dtype_name(tensor.dtype), shape]


def _nbytes(dtype_str, shape, rows=None):
    import torch

    n = math.prod(shape) if shape else 1
    if rows is not None:
        n *= rows
    return n * torch.empty((), dtype=torch_dtype(dtype_str)).element_size()


def _padded(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def padded_size(n):
    """`n` bytes rounded up to the 8-byte alignment `pack` uses."""
    return _padded(int(n))


def packed_size(metas, rows=None):
    """Bytes of the buffer `pack` makes for leaves described by `metas`."""
    return sum(_padded(_nbytes(d, s, rows)) for d, s in metas)


def pack(tensors):
    """Concatenates tensors' bytes (8-byte aligned) into one uint8 CPU tensor."""
    import torch

    parts = []
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        raw = t.reshape(-1).view(torch.uint8)
        parts.append(raw)
        pad = _padded(raw.numel()) - raw.numel()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(parts)


def pack_into(buffer, tensors, start=0):
    """Writes tensors into `buffer` in `pack`'s layout, without a new buffer.

    Args:
        buffer: A uint8 tensor of at least the packed size.
        tensors: Tensors with the same first (batch) dimension.
        start: Only rows `start:` of each tensor are written (the bytes of
            earlier rows are left as they are).

    Returns:
        The number of bytes the layout spans.
    """
    import torch

    offset = 0
    for t in tensors:
        t = t.detach()
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        n = t.numel() * t.element_size()
        view = buffer[offset:offset + n].view(t.dtype).reshape(t.shape)
        view[start:].copy_(t[start:])
        offset += _padded(n)
    return offset


def unpack(buffer, metas, rows=None):
    """Splits a `pack` buffer back into tensors of the given metas.

    Args:
        buffer: The uint8 tensor.
        metas: `[dtype, shape]` per tensor.
        rows: If given, each tensor has this leading dimension before `shape`.

    Returns:
        The tensors. On the CPU each shares `buffer`'s memory (no copy) but is
        a tensor of its own, not a view: views of one tensor share autograd's
        version counter, so an in-place op on one (Keras's masked losses
        multiply `sample_weight` in place) made backward refuse the inputs.
    """
    import torch

    # Same memory, one storage per tensor (a CPU tensor's numpy view is zero-copy).
    memory = buffer.numpy() if buffer.device.type == "cpu" else None
    out = []
    offset = 0
    for dtype_str, shape in metas:
        n = _nbytes(dtype_str, shape, rows)
        full_shape = ([rows] if rows is not None else []) + list(shape)
        if memory is not None and n:
            piece = torch.from_numpy(memory[offset:offset + n])
        else:
            piece = buffer[offset:offset + n]
        if dtype_str == "bool":
            t = piece.clone().view(torch.uint8).reshape(full_shape).to(torch.bool)
        else:
            t = piece.view(torch_dtype(dtype_str)).reshape(full_shape)
        out.append(t)
        offset += _padded(n)
    return out
