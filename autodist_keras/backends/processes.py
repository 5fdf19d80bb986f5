"""Process helpers shared by the backends' worker launchers (no framework imports)."""

import os


def process_alive(pid):
    """Whether a process with id `pid` exists (it may belong to another user).

    Args:
        pid: Process id.

    Returns:
        True if the process exists, including as a zombie not yet reaped.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reader_gone(fd, timeout_s=0.0):
    """Whether nobody holds the read end of the pipe whose write end is `fd`.

    On Linux, `poll()` on a pipe's write end reports `POLLERR` once every
    read end is closed; a worker uses this to notice that rank 0 has given up
    on it (see `torch_worker.watch_parent`). Where `poll()` is missing, this
    sleeps `timeout_s` and returns False.

    Example:

    ```python
    while not reader_gone(conn.fileno(), timeout_s=0.5):
        ...  # rank 0 still holds its end
    ```

    Args:
        fd: File descriptor of the pipe's write end.
        timeout_s: How long to wait for the last reader to go (0: just look).

    Returns:
        True if the pipe has no reader left.
    """
    import select
    import time

    if not hasattr(select, "poll"):
        time.sleep(timeout_s)
        return False
    poller = select.poll()
    # No event asked for: poll() still reports POLLERR and POLLHUP, so it
    # sleeps until the last reader goes (not merely until the pipe is writable).
    poller.register(fd, 0)
    try:
        events = poller.poll(max(0, int(timeout_s * 1000)))
    except OSError:
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)
