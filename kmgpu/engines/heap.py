"""The C heap's free pages given back to the system (glibc's ``malloc_trim``).

Freed host buffers stay resident in the heap of the thread that freed them, and glibc
splits freed large blocks for smaller allocations instead of returning them; the
engines trim where a call or a pass has just freed many of them (the callers say where
and why). ``map_large_blocks`` keeps glibc from growing its mmap threshold. A C library
without ``malloc_trim`` / ``mallopt``: nothing.
"""

_malloc_trim = None  # glibc's malloc_trim once looked up, False where there is none

#: glibc's ``mallopt`` parameter number for the mmap threshold (malloc.h)
_M_MMAP_THRESHOLD = -3

#: blocks of at least this many bytes are mapped on their own (``map_large_blocks``): a
#: layer's pieces and a step's buffers as well as whole layers, which are what the heap
#: kept (benchmarks/results/host-memory-cpu.md)
MAPPED_FROM = 1024 * 1024


def trim_heap():
    """``malloc_trim(0)``: every free page of the heap back to the system."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes

        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def map_large_blocks():
    """Blocks of ``MAPPED_FROM`` bytes or more mapped on their own, whatever was freed.

    glibc maps a large block (128 KiB or more) on its own at first, but each such block
    freed raises that threshold to its size (up to 32 MiB), so that from then on
    layer-sized blocks come from the heap, where a freed one is split for smaller
    allocations and stays resident. A fixed threshold turns that off: each large block
    goes back to the system when it is freed. Costs a page-fault pass over each new large
    block, so only processes whose device memory is host memory call it.
    """
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MAPPED_FROM)
    except (OSError, AttributeError):
        pass
