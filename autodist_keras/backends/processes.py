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
