"""klrl.loop.hostmem: freed heap pages go back to the kernel (RSS read from /proc, the C heap driven
through ctypes, independent of klrl)."""

import ctypes
import ctypes.util
import platform
import resource

import pytest

from klrl.loop.hostmem import release_freed_memory

MB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc(), reason="malloc_trim is glibc's")
def test_freed_heap_pages_are_released():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n, size = 2048, 64 * 1024  # 128 MiB in blocks below glibc's mmap threshold: on the heap
    before = rss()
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touched: resident
    pin = libc.malloc(size)  # keeps the top of the heap in use, as a long-lived allocation does
    ctypes.memset(pin, 1, size)
    for b in blocks:
        libc.free(b)
    held = rss()
    # free() alone keeps the pages resident (the case being fixed); other threads of the process (XLA's,
    # pytest's) allocate and free meanwhile, so half the 128 MiB is the bar, not all of it
    assert held - before > 64 * MB
    assert release_freed_memory() is True
    after = rss()
    libc.free(pin)
    assert held - after > 64 * MB  # 101-128 MiB measured


def test_without_malloc_trim_it_does_nothing(monkeypatch):
    import klrl.loop.hostmem as hostmem

    monkeypatch.setattr(hostmem, "_malloc_trim", lambda: None)  # e.g. macOS or musl
    assert hostmem.release_freed_memory() is False
