"""Shared-memory batch slots between rank 0 and the workers it spawned.

Spawned workers run on rank 0's machine, so rank 0 need not send each of them
its shard through a socket: it writes the global batch (the workers' rows) once
into a slot of a file in `/dev/shm` that every rank has mapped, and each worker
reads its rows as views of that memory. There are two slots, used in turn: rank
0 writes step `k + 1`'s batch only after step `k`'s gradient all-reduce, which
every worker joins only after it has finished step `k - 1`, the last step that
read the other slot.

The file is unlinked as soon as every worker has mapped it (the mappings stay
valid), so nothing is left in `/dev/shm` even if a process is killed later; if
rank 0 is killed before that, Python's resource tracker removes it.
When `/dev/shm` is missing or too small, `SharedSlots.create` returns None and
the runtime sends shards as messages (as it does under torchrun, whose ranks may
be on other machines).

Example:

```python
slots = SharedSlots.create(slot_bytes=1 << 20)      # rank 0
worker_slots = SharedSlots.open(slots.describe())   # a worker, from the JSON header
slots.unlink()                                      # once every worker has mapped it
```
"""

import os
import tempfile
import weakref

SHM_DIR = "/dev/shm"
NUM_SLOTS = 2


def unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _tracker_name(path):
    """The name under which Python's resource tracker can unlink `path`
    (`shm_unlink` names are relative to `/dev/shm`), or None elsewhere."""
    if os.path.dirname(os.path.abspath(path)) != SHM_DIR:
        return None
    return "/" + os.path.basename(path)


def _tell_tracker(action, path):
    name = _tracker_name(path)
    if name is None:
        return
    try:
        from multiprocessing import resource_tracker

        getattr(resource_tracker, action)(name, "shared_memory")
    except Exception:  # noqa: BLE001  (no tracker: the file is still unlinked by its owner)
        pass


def remove_owned(path):
    """Unlinks a file that `create_mapped` made and stops tracking it."""
    unlink_quietly(path)
    _tell_tracker("unregister", path)


def create_mapped(prefix, size, open_fn, directory=SHM_DIR):
    """Makes a file of `size` bytes in `directory` and maps it with `open_fn(path)`.

    The file's space is reserved up front (`posix_fallocate`), so a full
    `/dev/shm` is found here rather than as a crash on the first write. The
    file is registered with Python's resource tracker, so it is removed even if
    this process is killed before its owner unlinks it; owners unlink it with
    `remove_owned`. Also used by `torch_shm_reduce`.

    Args:
        prefix: Start of the file's name.
        size: Bytes to reserve.
        open_fn: Callable mapping the new file's path (its result is returned).
        directory: Where to make the file.

    Returns:
        `open_fn`'s result, or None if the directory is missing or the space
        cannot be reserved (nothing is left behind then).
    """
    if size <= 0 or not os.path.isdir(directory) or not hasattr(os, "posix_fallocate"):
        return None
    try:
        fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    except OSError:
        return None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        # If this process is killed before its owner unlinks the file (the
        # short window until every worker has mapped it), Python's resource
        # tracker, a separate process, unlinks it when this one is gone.
        _tell_tracker("register", path)
        return open_fn(path)
    except (OSError, RuntimeError):
        remove_owned(path)
        return None


class SharedSlots:
    """`NUM_SLOTS` equal byte slots in one shared file, mapped as a uint8 tensor.

    Args:
        path: The file.
        slot_bytes: Bytes per slot.
        owner: True on the rank that created the file (it unlinks it).
    """

    def __init__(self, path, slot_bytes, owner=False):
        import torch

        self.path = path
        self.slot_bytes = int(slot_bytes)
        size = self.slot_bytes * NUM_SLOTS
        self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._finalizer = weakref.finalize(self, remove_owned, path) if owner else None

    @classmethod
    def create(cls, slot_bytes, directory=SHM_DIR):
        """Rank 0: makes and maps a new file, or returns None if shared memory is unusable.

        The file's space is reserved up front (`posix_fallocate`), so a full
        `/dev/shm` is found here rather than as a crash on the first write.
        """
        slot_bytes = max(int(slot_bytes), 1)
        return create_mapped("autodist_keras_batch_", slot_bytes * NUM_SLOTS,
                             lambda path: cls(path, slot_bytes, owner=True), directory)

    @classmethod
    def open(cls, description):
        """A worker: maps the file `describe()` named on rank 0."""
        return cls(description["path"], description["slot_bytes"])

    def describe(self):
        """What a worker needs to map the slots (JSON-able)."""
        return {"path": self.path, "slot_bytes": self.slot_bytes}

    def slot(self, index):
        """The uint8 view of slot `index`."""
        start = int(index) * self.slot_bytes
        return self.buffer[start:start + self.slot_bytes]

    def unlink(self):
        """Removes the file (rank 0; existing mappings stay valid)."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self):
        """Removes the file (rank 0) and drops this rank's mapping: a deleted file
        still takes `/dev/shm` space while anything maps it."""
        self.unlink()
        self.buffer = None
