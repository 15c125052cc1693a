"""The workers' stdout/stderr, one pipe per rank, read by the thread that runs the call
(no reader threads): rank 0's text goes to ``sys.stdout`` as it comes (in Jupyter, the
cell that is running), every rank's last 8 KiB is kept for error messages, and the
end-of-call markers (``messages.END_MARK``) say when a call's output is complete."""

import codecs
import os
import sys
import time

from kmgpu.engines.torch.launch.messages import END_MARK

TAIL = 8192  # bytes of each rank's output kept for error messages


class RankOutputs:
    """The read ends of the ranks' output pipes, what came through them, and markers.

    Args:
        world: the number of ranks; ``pipes`` gets their read ends
            (``multiprocessing.Connection``) in rank order as they start.
    """

    CLOSED = 1 << 30  # added to a rank's marker count when its pipe is at end of file

    def __init__(self, world):
        self.pipes = []
        n = world
        self.ends = [0] * n
        self.tails = [bytearray() for _ in range(n)]
        self.pending = [b""] * n
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace")
                         for _ in range(n)]

    def read(self, rank):
        """Read what rank ``rank`` wrote (its pipe is readable); False at end of file."""
        out = self.pipes[rank]
        try:
            chunk = os.read(out.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            self.ends[rank] += self.CLOSED  # closed: nothing more will come
            self._emit(rank, self.pending[rank], final=True)
            self.pending[rank] = b""
            return False
        data = self.pending[rank] + chunk
        while END_MARK in data:
            before, data = data.split(END_MARK, 1)
            self._emit(rank, before)
            self.ends[rank] += 1
        keep = 0  # a marker may be split across reads
        for k in range(min(len(END_MARK) - 1, len(data)), 0, -1):
            if END_MARK.startswith(data[-k:]):
                keep = k
                break
        self._emit(rank, data[: len(data) - keep])
        self.pending[rank] = data[len(data) - keep:]
        return True

    def _emit(self, rank, data, final=False):
        if not data and not final:
            return
        tail = self.tails[rank]
        tail += data
        del tail[:-TAIL]
        text = self.decoders[rank].decode(data, final=final)
        if rank == 0 and text:
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except Exception:  # a closed or odd stdout must not end the call
                pass

    def open_pipes(self):
        return {out: r for r, out in enumerate(self.pipes) if self.ends[r] < self.CLOSED}

    def drain(self, ready):
        outs = self.open_pipes()
        for obj in ready:
            if obj in outs:
                self.read(outs[obj])

    def wait(self, ends, timeout=5.0):
        """Read output until every rank has written its end-of-call marker."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while any(m < want for m, want in zip(self.ends, ends)):
            left = deadline - time.monotonic()
            outs = self.open_pipes()
            if left <= 0 or not outs:
                return
            self.drain(wait(list(outs), timeout=min(left, 0.25)))

    def tail(self, rank):
        """Rank ``rank``'s last output, for an error message ("" when none)."""
        text = bytes(self.tails[rank]).decode("utf-8", "replace").strip()
        return f"--- last output of rank {rank} ---\n{text}" if text else ""
