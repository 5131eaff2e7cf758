"""The allocator measure the memory tests compare predictions against (tests/conftest.py: profiled_peak_rise)."""
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import profiled_peak_rise

KIB256 = 1 << 16  # float32 elements in 256 KiB


def _window(work):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    return prof


def test_a_block_from_an_earlier_window_freed_inside_this_one_does_not_lower_the_peak():
    """Two 256 KiB blocks alive at once inside the window: 512 KiB, whether or not a 1 MiB block that an earlier
    profiling window made is freed at the window's start (the CPU allocator reports that free with its size)."""
    held = {}
    _window(lambda: held.update(old=torch.ones(4 * KIB256)))

    def step():
        held.clear()  # the earlier window's block goes
        a, b = torch.ones(KIB256), torch.ones(KIB256)
        del a, b

    prof = _window(step)
    assert profiled_peak_rise(prof) == 2 * KIB256 * 4
    assert profiled_peak_rise(prof, earlier_frees=True) == 0  # the caller that counts the earlier block itself


def test_the_peak_is_the_highest_point_not_the_sum():
    def step():
        a = torch.ones(KIB256)
        del a
        b = torch.ones(2 * KIB256)
        del b

    assert profiled_peak_rise(_window(step)) == 2 * KIB256 * 4
