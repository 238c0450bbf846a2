"""How this process computes, set where a command or a worker starts: torch's threads, and a heap that
keeps the memory it frees."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20
"""Allocations under this come from the heap: glibc's largest allowed (32 MiB on 64-bit)."""


def configure(threads: int) -> None:
    """`threads` for torch's CPU operations (the same floats need the same number), and `keep_freed_memory`."""
    torch.set_num_threads(threads)
    keep_freed_memory()


@functools.cache
def keep_freed_memory() -> bool:
    """The heap keeps the memory it frees instead of handing it back to the kernel. By default glibc trims
    its heap's free top once it exceeds twice the last freed mapping and maps each larger allocation
    afresh, so a training step's tensors of 5-25 MB (activations, the head's chunks) were page-faulted in
    anew, page by page, every time: ~90,000 faults and ~6% of a SmolLM2 update minibatch. With a fixed
    mapping threshold and no trimming the process's resident memory stays at its high-water mark (which the
    peak figures count anyway). False where the C library has no `mallopt` (not glibc): nothing changes."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
