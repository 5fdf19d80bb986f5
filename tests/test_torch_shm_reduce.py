"""The shared-memory reduce area: layout, slices, mappings and layout checks.

Real files in /dev/shm (or a temporary directory), real torch tensors. The
distributed sums themselves are tested through real spawned fits in
tests/test_runtime_torch.py.
"""

import os
import re

import keras
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="only the PyTorch runtime uses the shared-memory reduce area; run under torch only",
)

from autodist_keras.backends import torch_shm_reduce as sr  # noqa: E402
from autodist_keras.errors import BackendError  # noqa: E402


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000, 10_250, 1_590_000])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_slices_cover_every_element_once(numel, world):
    covered = []
    for rank in range(world):
        start, stop = sr.slice_bounds(numel, world, rank)
        assert 0 <= start <= stop <= numel
        if stop > start:
            assert start % sr.CHUNK_ELEMENTS == 0
        covered.extend(range(start, stop))
    assert covered == list(range(numel))


def test_regions_are_aligned_and_sized_for_every_rank_and_the_sum():
    buckets = [(10, "torch.float32"), (3, "torch.float64")]
    assert sr.area_bytes(buckets, 2) == 3 * 64 + 3 * 64
    assert sr.area_bytes([(17, "torch.float32")], 3) == 4 * 128


def test_two_mappings_share_memory_and_sum_in_rank_order(tmp_path):
    buckets = [(37, "torch.float32"), (5, "torch.float64")]
    owner = sr.ReduceArea.create(buckets, world=3, directory=str(tmp_path))
    assert owner is not None and os.path.exists(owner.path)
    other = sr.ReduceArea.open(owner.describe(), buckets=buckets)
    for rank, region in enumerate(other.inputs(0)):
        region.copy_(torch.arange(37, dtype=torch.float32) * (rank + 1))
    # Rank 1 sums its slice on one mapping; the owner sees it on the other.
    for rank in range(3):
        start, stop = sr.slice_bounds(37, 3, rank)
        sr.sum_into(other.output(0), other.inputs(0), start, stop)
    expected = torch.arange(37, dtype=torch.float32) * 6
    assert torch.equal(owner.output(0), expected)
    assert owner.output(1).dtype == torch.float64 and owner.output(1).numel() == 5
    owner.unlink()
    assert not os.path.exists(owner.path)
    assert torch.equal(other.output(0), expected)  # the mappings outlive the file


def test_a_different_layout_is_refused_with_both_layouts(tmp_path):
    owner = sr.ReduceArea.create([(8, "torch.float32")], world=2, directory=str(tmp_path))
    with pytest.raises(BackendError, match=r"Received: \[\(9, 'torch.float32'\)\]"):
        sr.ReduceArea.open(owner.describe(), buckets=[(9, "torch.float32")])
    owner.unlink()


def test_no_usable_directory_means_no_area(tmp_path):
    assert sr.ReduceArea.create([(8, "torch.float32")], 2, directory=str(tmp_path / "none")) is None
    assert sr.ReduceArea.create([], 2, directory=str(tmp_path)) is None
    assert os.listdir(tmp_path) == []


_KILLED_OWNER = """
import sys, time
from autodist_keras.backends.torch_shm import SharedSlots
from autodist_keras.backends.torch_shm_reduce import ReduceArea
slots = SharedSlots.create(1 << 16)
area = ReduceArea.create([(1024, "float32")], 2)
print(slots.path, area.path, flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)  # owners unlink at exit
time.sleep(600)  # killed here, before any worker mapped the files
"""


@pytest.mark.parametrize("end", ["sigkill", "exit"])
def test_shared_files_are_removed_even_if_their_owner_is_killed(end):
    """Rank 0 unlinks its files once every worker has mapped them; if it is
    killed before that, Python's resource tracker removes them."""
    import signal
    import subprocess
    import sys
    import time

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_OWNER, end], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        paths = proc.stdout.readline().split()
        assert len(paths) == 2 and all(p.startswith("/dev/shm/autodist_keras_") for p in paths)
        if end == "sigkill":
            assert all(os.path.exists(p) for p in paths)
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in paths if os.path.exists(p)]
        if end == "exit":
            assert proc.returncode == 0
            assert "leaked" not in proc.stderr.read()  # nothing left for the tracker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _unshare_available():
    import shutil

    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("unshare") is not None


_TOO_SMALL = """
import warnings
from autodist_keras.backends.torch_shm import SharedSlots
from autodist_keras.backends.torch_shm_reduce import ReduceArea
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    area = ReduceArea.create([(1 << 17, "float32")], 2)
    slots = SharedSlots.create(1 << 20)
print("RESULT", area, slots, len(caught), flush=True)
for w in caught:
    print("WARNING", str(w.message).replace(chr(10), " "), flush=True)
"""


def test_a_too_small_dev_shm_warns_once_and_prints_no_tracker_traceback():
    """A /dev/shm too small for the files (Docker's default 64 MB, here 64 KiB in a
    private mount namespace): the runtime falls back to gloo and to messages, with one
    warning per file. It did so silently, and Python's resource tracker printed a `KeyError` traceback per file,
    because the files that were never registered with it were unregistered."""
    import subprocess
    import sys

    if not _unshare_available():
        pytest.skip("needs root and unshare(1) to mount a small tmpfs over /dev/shm")
    command = ("mount -t tmpfs -o size=64k tmpfs /dev/shm && exec \"$0\" -c \"$1\"")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", command, sys.executable, _TOO_SMALL],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "RESULT" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: {proc.stderr[-300:]}")
    assert "RESULT None None 2" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "KeyError" not in proc.stderr, proc.stderr
    warning, batch_warning = [line for line in proc.stdout.splitlines()
                              if line.startswith("WARNING")]
    assert "/dev/shm could not hold the 1.5 MiB file in which the PyTorch runtime's " \
           "processes sum gradients (free: 0.1 MiB)" in warning, warning
    assert "gradients are summed through gloo" in warning
    assert "--shm-size" in warning and "AUTODIST_KERAS_TORCH_SHM_REDUCE=0" in warning
    assert re.search(r"Received: 1572864 bytes needed, \d+ bytes free in /dev/shm$", warning)
    # The batch slots fell back to messages silently until session 26.
    assert "/dev/shm could not hold the 2.0 MiB file in which the PyTorch runtime hands " \
           "each spawned worker its rows of the batch" in batch_warning, batch_warning
    assert "through a socket" in batch_warning and "AUTODIST_KERAS_TORCH_SHM=0" in batch_warning
    assert re.search(r"Received: 2097152 bytes needed, \d+ bytes free in /dev/shm$",
                     batch_warning)


_KILLED_GROUP = """
import os, time
from autodist_keras.backends.torch_shm_reduce import ReduceArea
area = ReduceArea.create([(1024, "float32")], 2)
print(area.path, flush=True)
time.sleep(600)  # the whole process group, resource tracker included, is killed here
"""


def test_files_of_a_killed_process_group_are_removed_by_the_next_file_made():
    """A SIGKILL to a job's whole process group during set-up kills the resource
    tracker with rank 0, so nobody removes the file: it stayed in /dev/shm forever.
    Its name now carries the creator's pid, and the next file made removes the
    files of processes that are gone, not those of a job still running."""
    import signal
    import subprocess
    import sys
    import time

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    left = kept = None
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_GROUP], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    alive = subprocess.Popen([sys.executable, "-c", _KILLED_GROUP], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        left = killed.stdout.readline().strip()
        kept = alive.stdout.readline().strip()
        assert os.path.exists(left) and os.path.exists(kept)
        assert f"_{killed.pid}_" in os.path.basename(left)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        time.sleep(1.0)
        assert os.path.exists(left)  # nobody left to remove it ...
        area = sr.ReduceArea.create([(16, "torch.float32")], 2)
        try:
            assert not os.path.exists(left)  # ... until the next file is made
            assert os.path.exists(kept)  # a live job's file stays
        finally:
            area.unlink()
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
        alive.kill()  # alone: its resource tracker removes its file
        alive.wait()
        for path in (left, kept):
            deadline = time.monotonic() + 20
            while path and os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.1)
        if left and os.path.exists(left):
            os.unlink(left)
