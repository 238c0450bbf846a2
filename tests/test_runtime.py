"""The process's compute settings: large freed blocks go back to the kernel."""

import platform
import subprocess
import sys

import pytest

PROGRAM = """
import sys, torch
from tempering.runtime import fixed_mmap_threshold
if sys.argv[1] == "fixed":
    assert fixed_mmap_threshold()
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
first = torch.ones(6_000_000)
del first                                            # glibc's default raises its threshold past 24 MB here
tensors = [torch.ones(6_000_000) for _ in range(4)]  # 4 x 24 MB, as a step's activations
pinned = torch.ones(1000)                            # allocated after them: the heap's top stays in use
held = resident_mb()
del tensors
print(held - resident_mb())
"""


def _given_back_mb(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and Linux's /proc")
def test_freed_tensors_memory_goes_back_to_the_kernel_instead_of_staying_stranded_in_the_heap():
    assert _given_back_mb("default") < 8   # glibc's default: kept in the heap, behind a live block
    assert _given_back_mb("fixed") > 80
