"""The C heap's free pages given back to the system (glibc's ``malloc_trim``).

Freed host buffers stay resident in the heap of the thread that freed them, and glibc
splits freed large blocks for smaller allocations instead of returning them; the
engines trim where a call or a pass has just freed many of them (the callers say where
and why). A C library without ``malloc_trim``: nothing.
"""

_malloc_trim = None  # glibc's malloc_trim once looked up, False where there is none


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
