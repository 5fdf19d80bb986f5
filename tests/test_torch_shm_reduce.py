"""The shared-memory reduce area: layout, slices, mappings and layout checks.

Real files in /dev/shm (or a temporary directory), real torch tensors. The
distributed sums themselves are tested through real spawned fits in
tests/test_runtime_torch.py.
"""

import os

import pytest

torch = pytest.importorskip("torch")

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
