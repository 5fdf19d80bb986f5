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
rank 0 is killed before that, Python's resource tracker removes it. If the
tracker is killed too (a kill of the whole process group, a container's cgroup),
the file's name says which process made it (`autodist_keras_batch_<pid>_...`),
and the next file made on the machine removes it once that process is gone
(`sweep_orphans`).
When `/dev/shm` is missing or too small, `SharedSlots.create` returns None and
the runtime sends shards as messages (as it does under torchrun, whose ranks may
be on other machines); when it is too small, it also warns (`warn_no_space`),
with the sizes and how to enlarge it.

Example:

```python
slots = SharedSlots.create(slot_bytes=1 << 20)      # rank 0
worker_slots = SharedSlots.open(slots.describe())   # a worker, from the JSON header
slots.unlink()                                      # once every worker has mapped it
```
"""

import errno
import os
import re
import tempfile
import warnings
import weakref

from autodist_keras.backends.processes import process_alive
from autodist_keras.stacklevel import user_stacklevel

SHM_DIR = "/dev/shm"
NUM_SLOTS = 2
# The names `create_mapped` gives its files: a prefix such as
# "autodist_keras_grads_", the creator's pid, the inode of its PID namespace
# (0 when unknown), then mkstemp's random part.
_OWNED_NAME = re.compile(r"^autodist_keras_[a-z]+_(\d+)_(\d+)_[^/]+$")
# Errors of `posix_fallocate` that mean the directory cannot hold the file.
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


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


def _pid_namespace():
    """The inode of this process's PID namespace, or 0 where it cannot be read.

    Containers that share `/dev/shm` may still have PID namespaces of their
    own, where another container's pids do not exist: files are swept only by
    processes of the namespace that made them.
    """
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return 0
    match = re.search(r"\[(\d+)\]", link)
    return int(match.group(1)) if match else 0


def sweep_orphans(directory=SHM_DIR, namespace=None):
    """Removes the files `create_mapped` made in `directory` for processes that are gone.

    A file is unlinked by its owner once every worker mapped it, or by Python's
    resource tracker if the owner dies first; when both are killed at once (a
    SIGKILL to the whole process group during the short set-up window) the
    file would stay until reboot. Its name carries the creator's pid and PID
    namespace, so a later job can tell: files of this namespace whose creator
    no longer runs are removed, those of live jobs (and of other namespaces,
    and names without a pid) are left alone. One `listdir` and a `kill(pid, 0)`
    per file of this package: cheap enough to run at every `create_mapped`.

    Args:
        directory: Where to look.
        namespace: This process's PID namespace (`_pid_namespace()`, read
            when None).

    Returns:
        The paths removed.
    """
    if namespace is None:
        namespace = _pid_namespace()
    if not namespace:
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _OWNED_NAME.match(name)
        if match is None or int(match.group(2)) != namespace:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or process_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append(path)
    return removed


def free_bytes(directory):
    """Bytes an unprivileged process may still allocate in `directory` (0 if unknown)."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def warn_no_space(directory, size, free, holds, instead, variable):
    """Warns that `directory` could not hold a file of `size` bytes, what the
    runtime does instead, and how to enlarge it or opt out.

    Args:
        directory: Where the file was to be made.
        size: Bytes the file needed.
        free: Bytes free in `directory`.
        holds: What the file is for, completing "the file in which ...".
        instead: What happens instead, a sentence fragment.
        variable: The environment variable that, set to 0, chooses the
            fallback and silences the warning.
    """
    mib = 1 << 20
    warnings.warn(
        f"autodist_keras: {directory} could not hold the {size / mib:.1f} MiB file in which "
        f"{holds} (free: {free / mib:.1f} MiB), so {instead}. Enlarge {directory} "
        f"(Docker: `docker run --shm-size=1g ...`; elsewhere "
        f"`mount -o remount,size=2G {directory}`), or set {variable}=0 to choose that "
        f"and silence this warning. Received: {size} bytes needed, {free} bytes free in "
        f"{directory}",
        stacklevel=user_stacklevel(),
    )


def create_mapped(prefix, size, open_fn, directory=SHM_DIR, no_space=None):
    """Makes a file of `size` bytes in `directory` and maps it with `open_fn(path)`.

    The file's space is reserved up front (`posix_fallocate`), so a full
    `/dev/shm` is found here rather than as a crash on the first write. The
    file is registered with Python's resource tracker, so it is removed even if
    this process is killed before its owner unlinks it; owners unlink it with
    `remove_owned`. Its name is `prefix`, this process's pid and PID namespace,
    and a random part, and files left by processes that are gone are removed
    first (`sweep_orphans`). Also used by `torch_shm_reduce`.

    Args:
        prefix: Start of the file's name, `"autodist_keras_<kind>_"`.
        size: Bytes to reserve.
        open_fn: Callable mapping the new file's path (its result is returned).
        directory: Where to make the file.
        no_space: Optional `(holds, instead, variable)` for `warn_no_space`:
            when `directory` cannot hold the file, a warning says what the
            file is for, what the runtime does instead and how to opt out.

    Returns:
        `open_fn`'s result, or None if the directory is missing or the space
        cannot be reserved (nothing is left behind then).
    """
    if size <= 0 or not os.path.isdir(directory) or not hasattr(os, "posix_fallocate"):
        return None
    namespace = _pid_namespace()
    sweep_orphans(directory, namespace)
    try:
        fd, path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}_{namespace}_", dir=directory)
    except OSError:
        return None
    registered = False
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        # If this process is killed before its owner unlinks the file (the
        # short window until every worker has mapped it), Python's resource
        # tracker, a separate process, unlinks it when this one is gone.
        _tell_tracker("register", path)
        registered = True
        return open_fn(path)
    except (OSError, RuntimeError) as e:
        if registered:
            remove_owned(path)
        else:
            # Never registered: telling the tracker to forget it would make
            # the tracker print a KeyError traceback when this process ends.
            unlink_quietly(path)
        if no_space is not None and getattr(e, "errno", None) in _NO_SPACE:
            warn_no_space(directory, size, free_bytes(directory), *no_space)
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
        A `directory` too small for the file is also a warning.
        """
        slot_bytes = max(int(slot_bytes), 1)
        return create_mapped(
            "autodist_keras_batch_", slot_bytes * NUM_SLOTS,
            lambda path: cls(path, slot_bytes, owner=True), directory,
            no_space=("the PyTorch runtime hands each spawned worker its rows of the batch",
                      "rank 0 sends every worker its rows through a socket, one more copy "
                      "per step",
                      "AUTODIST_KERAS_TORCH_SHM"))

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
