"""The process's compute settings: large freed blocks go back to the kernel."""

import os
import platform
import subprocess
import sys

import pytest

PROGRAM = """
import ctypes, sys, torch
from tempering.runtime import fixed_mmap_threshold
if sys.argv[1] == "fixed":
    assert fixed_mmap_threshold()
class Mallinfo2(ctypes.Structure):  # glibc's struct mallinfo2: the heap's and the mappings' bytes
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
first = torch.ones(6_000_000)
del first                                            # glibc's default raises its threshold past 24 MB here
before = mallinfo2().hblkhd
tensors = [torch.ones(6_000_000) for _ in range(4)]  # 4 x 24 MB, as a step's activations
pinned = torch.ones(1000)                            # allocated after them
mapped = (mallinfo2().hblkhd - before) >> 20
held = resident_mb()
del tensors
print(mapped, held - resident_mb())
"""


def _mapped_and_given_back_mb(mode: str) -> tuple[int, int]:
    env = {
        k: v
        for k, v in os.environ.items()  # glibc's own defaults, whatever this shell tunes
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True, env=env
    )
    mapped, given_back = out.stdout.split()[-2:]
    return int(mapped), int(given_back)


def _glibc_with_mallinfo2() -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(part) for part in version.split(".")[:2]) >= (2, 33)


@pytest.mark.skipif(
    not _glibc_with_mallinfo2(), reason="glibc's mallopt and mallinfo2 (2.33+), Linux's /proc"
)
def test_freed_tensors_memory_goes_back_to_the_kernel_instead_of_staying_stranded_in_the_heap():
    # glibc's default serves them from the heap, where a later live block can strand them after they are freed
    # (whether one does depends on the heap's layout: not asserted)
    mapped, _ = _mapped_and_given_back_mb("default")
    assert mapped < 8
    mapped, given_back = _mapped_and_given_back_mb("fixed")
    assert mapped > 90 and given_back > 80  # each its own mapping, returned when freed
