"""The kernel API's small public helpers: packed boundaries, segment checks, scratch buffers."""
import threading

import pytest
import torch
from hypothesis import given, strategies as st

from fusedreduce.kernels import check_segments, packed_boundaries, scratch_buffer

CPU = torch.device("cpu")


@given(numels=st.lists(st.integers(0, 10_000), max_size=20))
def test_packed_boundaries_start_at_0_and_step_by_each_size(numels):
    boundaries = packed_boundaries(numels)
    assert boundaries[0] == 0 and len(boundaries) == len(numels) + 1
    assert [hi - lo for lo, hi in zip(boundaries, boundaries[1:])] == numels


def test_check_segments_returns_the_boundaries_as_ints_and_refuses_bad_ones():
    assert check_segments(torch.tensor([0, 2, 2, 7]), 7) == [0, 2, 2, 7]
    assert check_segments([0, 3]) == [0, 3]
    with pytest.raises(ValueError, match="segments"):
        check_segments([0, 3], 4)
    with pytest.raises(ValueError, match="decrease"):
        check_segments([0, 5, 3])
    with pytest.raises(TypeError, match=r"segments\[1\]"):
        check_segments([0, 2.5])


def test_a_cpu_scratch_buffer_is_kept_per_name_and_dtype_and_grows_when_asked_for_more():
    first = scratch_buffer("test_kept", (4, 5), torch.float64, CPU)
    again = scratch_buffer("test_kept", (20,), torch.float64, CPU)
    assert first.shape == (4, 5) and again.shape == (20,)
    assert again.data_ptr() == first.data_ptr()
    other_dtype = scratch_buffer("test_kept", (20,), torch.float32, CPU)
    assert other_dtype.data_ptr() != first.data_ptr()
    larger = scratch_buffer("test_kept", (100,), torch.float64, CPU)
    assert larger.numel() == 100
    assert scratch_buffer("test_kept", (3,), torch.float64, CPU).data_ptr() == larger.data_ptr()


def test_threads_get_scratch_buffers_of_their_own():
    mine = scratch_buffer("test_threads", (8,), torch.float64, CPU)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(
        scratch_buffer("test_threads", (8,), torch.float64, CPU).data_ptr()))
    thread.start()
    thread.join()
    assert theirs[0] != mine.data_ptr()
