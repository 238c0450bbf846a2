"""The process's compute settings: a heap that keeps what it frees."""

import platform
import subprocess
import sys

import pytest

PROGRAM = """
import sys, torch
from tempering.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
tensors = [torch.ones(6_000_000) for _ in range(4)]  # 4 x 24 MB, as a step's activations and logit chunks
held = resident_mb()
del tensors
print(held - resident_mb())
"""


def _handed_back_mb(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and Linux's /proc")
def test_the_heap_keeps_what_a_step_frees_for_the_next_instead_of_handing_it_back_to_the_kernel():
    assert _handed_back_mb("default") > 80  # glibc's default: unmapped or trimmed, faulted in again next time
    assert _handed_back_mb("keep") < 8
