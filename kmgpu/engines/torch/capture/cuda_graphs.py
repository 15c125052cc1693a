"""CUDA-graph capture that leaves torch as it found it.

``torch.cuda.graph`` (torch 2.11) is not clean when a capture fails: its ``__exit__``
calls ``capture_end``, whose ``cudaStreamEndCapture`` raises on an invalidated
capture (a host read, a blocking copy, a CPU sync under ``capture_error_mode=
"thread_local"``: "operation failed due to a previous error during capture"). The
exception leaves three things behind: the current stream stays torch's capture
stream (``stream_ctx.__exit__`` never runs), the caching allocator keeps routing
into the graph's private pool which is never released (``endAllocateToPool`` and
``releasePool`` come after the failed call, ``reset`` releases only an ended
capture), and the default CUDA generator's state stays marked as capturing
(``capture_epilogue`` comes after it too), so the next eager dropout anywhere in the
process raises "Offset increment outside graph capture encountered unexpectedly".
``capture`` ends a failed capture itself: the stream put back, the pool ended and
released, the generator's capture state closed with a tiny capture that succeeds.

Side streams: this module owns them, one per device (``side_stream``), for every
capture and every eager warm-up step (``aside``): capture wants the work before it off
the default stream, graphs sharing a memory pool want one capture stream, and with one
stream cuBLAS's per-stream workspace is made once, at the first warm-up, outside any
graph's pool.

The float32 matmul policy the captured steps run under is ``precision``'s.
"""

import gc
import re

import torch

_STREAMS = {}


def side_stream(device=None):
    """The device's one side stream (None, or a device without an index: the current one)."""
    key = None if device is None else torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key)
    return _STREAMS[key]


def aside(device, fn):
    """``fn()`` eagerly on the device's side stream, after the work queued on the current
    stream and before what is queued there next (a warm-up step, as capture wants)."""
    side, main = side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn()
    main.wait_stream(side)
    return out


def recover(device):
    """After a failed capture or replay: free what referred to it and wait for the device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device):
    """After graphs are dropped: their pools' memory back to the device (nothing refers
    to it once collected; the caching allocator's cache emptied)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def capture(fn, pool=None):
    """Record ``fn()`` into a new CUDA graph (nothing runs yet); if anything fails,
    torch's CUDA state is put back as it was (module docstring) and the error raised.

    Returns:
        (the graph, what ``fn`` returned: tensors the replays overwrite).
    """
    graph = torch.cuda.CUDAGraph()
    device = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    if pool is None:
        # a new private pool cannot take the blocks the caching allocator keeps for eager
        # steps (the warm-up's activations): handed back to the device first, so a large
        # model's warm-up cache and its graphs' pools do not both have to fit
        torch.cuda.empty_cache()
        pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(side_stream(device)):  # restores the caller's stream, always
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = fn()
        except BaseException:
            _abandon(graph, pool, device, ended=False)
            raise
        try:
            graph.capture_end()
        except BaseException:
            _abandon(graph, pool, device, ended=True)
            raise
    return graph, out


def _abandon(graph, pool, device, ended):
    """End a capture that failed (``ended``: its capture_end already raised)."""
    if not ended:
        try:
            graph.capture_end()  # a Python error in a valid capture: ends cleanly
            return
        except Exception:
            pass
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool",
                 "_cuda_releasePool"):
        fn = getattr(torch._C, name, None)
        if fn is None or (name.endswith("StreamToPool")
                          and hasattr(torch._C, "_cuda_endAllocateToPool")):
            continue
        try:
            fn(device, pool)
        except Exception:  # already ended by this torch version's capture_end
            pass
    del graph
    gc.collect()
    reset_generators(device)


def reset_generators(device):
    """Close a failed capture's state in the device's default generator: a capture that
    succeeds (it opens and closes the generator's capture state) of nothing but a
    dropout (so the generator takes part), then dropped."""
    try:
        torch.cuda.synchronize(device)
    except Exception:
        pass
    ok = torch.cuda.CUDAGraph()
    x = torch.ones(4, device=f"cuda:{device}")
    with torch.cuda.stream(side_stream(device)):
        ok.capture_begin(capture_error_mode="thread_local")
        try:
            torch.nn.functional.dropout(x, 0.5, training=True)
        finally:
            ok.capture_end()
    torch.cuda.synchronize(device)
    del ok


def state(device=None):
    """What ``capture`` must leave as it found it, for the checks
    (benchmarks/lab/torch_capture_checks.py): the current stream, whether a plain eager
    dropout draws (the generator), bytes reserved."""
    try:
        torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5, training=True)
        dropout = "ok"
    except Exception as e:  # the generator still thinks it captures
        dropout = why(e)
    torch.cuda.synchronize()
    return {"stream": int(torch.cuda.current_stream().cuda_stream), "dropout": dropout}


def why(e):
    """One line for an exception: its type and first line (Keras's wrapper: the layer
    and the cause), at most 300 characters."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines()
             if ln.strip()]
    text = lines[0] if lines else ""
    if text.startswith("Exception encountered when calling") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(e).__name__}: {text}"[:300]
