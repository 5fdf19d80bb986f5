"""Gradient sums through shared memory, for ranks that share one machine's CPUs.

Workers that rank 0 spawned run on rank 0's machine. When every replica is a
CPU device, gloo sums a gradient bucket by sending it through loopback TCP,
and each rank's kernel copies it in and out of socket buffers on the rank's
own core: on the CPU testbed (one core per rank) a 6.4 MB all-reduce between
two ranks took 7.2 ms. Through one shared file it took 1.3 ms, barriers
included (`docs/runtime_torch.md`, "Gradient sums through shared memory").

`ReduceArea` is that file. Per gradient bucket it holds one input region per
rank and one output region. A bucket is summed in three moves:

1. each rank copies its gradients into its own input region (the copy into a
   flat bucket that the gloo path makes anyway);
2. **arrival barrier**: a one-element gloo all-reduce, launched as soon as the
   bucket is full (during backward) and waited for after backward;
3. each rank sums its slice of the bucket over every rank's input, in rank
   order, into the output region (for a parameter-server bucket the server
   sums all of it, so the server does the work a PS does), then the **done
   barrier**, then every rank copies the output into its own buffer.

Every rank reads the same output, so replicas stay bit-identical. The
barriers travel through the same gloo group as every other collective of the
step, in the same order on every rank (all arrivals, then all dones), and a
socket round trip orders memory between processes on any CPU, so no rank
reads a region before its writer is done with it. A rank writes its input
region of step `k + 1` only after it copied step `k`'s output, and nobody
reads the inputs after the done barrier; the output of step `k + 1` is written
only after every rank arrived at step `k + 1`, hence after every rank copied
step `k`'s output.

The file is unlinked once every rank has mapped it, so nothing is left in
`/dev/shm` if a process is killed. When `/dev/shm` is missing or too small,
`ReduceArea.create` returns None and gloo sums the buckets; when it is too
small, it also warns, with the sizes and how to enlarge it.

Example:

```python
area = ReduceArea.create([(1590000, "torch.float32")], world=2)   # rank 0
area_on_worker = ReduceArea.open(area.describe())                # rank 1
area.unlink()                                                    # once both mapped it
```
"""

import weakref

from autodist_keras.backends import torch_transport as tt
from autodist_keras.backends.torch_shm import SHM_DIR
from autodist_keras.backends.torch_shm import remove_owned
from autodist_keras.backends.torch_shm import create_mapped
from autodist_keras.errors import BackendError

ALIGN_BYTES = 64  # one cache line: regions of different ranks never share one
CHUNK_ELEMENTS = 16  # slices start on a multiple of this many elements


def _dtype(name):
    """`"torch.float32"` (a bucket's dtype name) -> `torch.float32`."""
    return tt.torch_dtype(tt.dtype_name(name))


def _region_bytes(numel, dtype):
    nbytes = int(numel) * _dtype(dtype).itemsize
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def area_bytes(buckets, world):
    """Bytes of the file for `buckets` (`[(numel, dtype), ...]`) and `world` ranks."""
    return sum((int(world) + 1) * _region_bytes(n, d) for n, d in buckets)


def slice_bounds(numel, world, rank):
    """`(start, stop)` of the elements `rank` sums, for a bucket of `numel`.

    Slices are about `numel / world` long, start on a multiple of
    `CHUNK_ELEMENTS`, and cover the bucket once; trailing ranks may get an
    empty slice.
    """
    numel, world, rank = int(numel), int(world), int(rank)
    chunk = -(-numel // world)
    chunk = -(-chunk // CHUNK_ELEMENTS) * CHUNK_ELEMENTS
    start = min(numel, rank * chunk)
    return start, min(numel, start + chunk)


class ReduceArea:
    """One shared file: per bucket, `world` input regions and one output region.

    Args:
        path: The file.
        buckets: `[(numel, dtype name), ...]`, one per gradient bucket, in the
            reducer's order.
        world: Number of ranks.
        owner: True on the rank that created the file (it unlinks it).
    """

    def __init__(self, path, buckets, world, owner=False):
        import torch

        self.path = path
        self.buckets = [(int(n), str(d)) for n, d in buckets]
        self.world = int(world)
        size = area_bytes(self.buckets, self.world)
        self._finalizer = weakref.finalize(self, remove_owned, path) if owner else None
        self.buffer = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)
        self._views = []
        offset = 0
        for numel, dtype_name in self.buckets:
            dtype = _dtype(dtype_name)
            step = _region_bytes(numel, dtype_name)
            regions = []
            for _ in range(self.world + 1):
                regions.append(self.buffer[offset:offset + numel * dtype.itemsize].view(dtype))
                offset += step
            self._views.append(regions)

    @classmethod
    def create(cls, buckets, world, directory=SHM_DIR):
        """Rank 0: makes and maps a new file, or returns None if shared memory is unusable.

        The file's space is reserved up front (`posix_fallocate`), so a full
        `/dev/shm` is found here rather than as a crash on the first write.

        Args:
            buckets: `[(numel, dtype name), ...]`, one per gradient bucket.
            world: Number of ranks.
            directory: Where to make the file.

        Returns:
            A `ReduceArea`, or None (with a warning when `directory` is too small).
        """
        return create_mapped("autodist_keras_grads_", area_bytes(buckets, world),
                             lambda path: cls(path, buckets, world, owner=True), directory,
                             no_space=("the PyTorch runtime's processes sum gradients",
                                       "gradients are summed through gloo over loopback "
                                       "instead, several times slower for large buckets",
                                       "AUTODIST_KERAS_TORCH_SHM_REDUCE"))

    @classmethod
    def open(cls, description, buckets=None):
        """A worker: maps the file `describe()` named on rank 0.

        Args:
            description: Rank 0's `describe()`.
            buckets: This rank's own bucket layout; if given, it must equal
                rank 0's (they come from the same plan and model).

        Raises:
            BackendError: If the layouts differ.
        """
        theirs = [(int(n), str(d)) for n, d in description["buckets"]]
        if buckets is not None:
            mine = [(int(n), str(d)) for n, d in buckets]
            if mine != theirs:
                raise BackendError(
                    "This rank's gradient buckets differ from rank 0's, so they cannot be "
                    "summed in shared memory; every rank must build the same model. "
                    f"Received: {mine[:4]} vs rank 0's {theirs[:4]}"
                )
        return cls(description["path"], theirs, description["world"])

    def describe(self):
        """What a worker needs to map the area (JSON-able)."""
        return {"path": self.path, "buckets": [list(b) for b in self.buckets], "world": self.world}

    def inputs(self, bucket):
        """The input regions of bucket `bucket`, one tensor per rank."""
        return self._views[bucket][:self.world]

    def output(self, bucket):
        """The output region of bucket `bucket`."""
        return self._views[bucket][self.world]

    def unlink(self):
        """Removes the file (rank 0; existing mappings stay valid)."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self):
        """Removes the file (rank 0) and drops this object's views of the mapping
        (it is unmapped once no tensor of the caller's views it either)."""
        self.unlink()
        self.buffer = None
        self._views = []


def sum_into(output, inputs, start, stop):
    """Sums `inputs[r][start:stop]` over ranks, in rank order, into `output[start:stop]`."""
    import torch

    if stop <= start:
        return
    out = output[start:stop]
    if len(inputs) == 1:
        out.copy_(inputs[0][start:stop])
        return
    torch.add(inputs[0][start:stop], inputs[1][start:stop], out=out)
    for tensor in inputs[2:]:
        out.add_(tensor[start:stop])
