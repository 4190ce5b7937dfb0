"""The file backend's fsync agent: a tiny process that makes a store's log durable on request.

Run as `python -I -S _fsync_agent.py LOG REQUESTS ACKS` with three inherited descriptors: the
store's log, the read end of a request pipe and the write end of an acknowledgement pipe. The
store appends a batch to the log and then writes its 8-byte sequence number to REQUESTS. The
agent reads every request waiting, fsyncs the log once, and answers with the last sequence
number it read and an errno (0 for success): every batch up to that number was appended before
the fsync began, so it is on disk. The agent exits when REQUESTS reaches end of file, which
happens when the store closes or its process dies.

Why a process: a Python thread returning from `fsync` must take the GIL back, and while the
event loop is busy staging the next writes it waits up to the 5 ms switch interval, so a thread
cannot overlap syncing with the loop's work. This process has no GIL to share. It imports
nothing but `os`, `signal` and `sys`, and starts in about 15 ms.
"""

import os
import signal
import sys


def serve(log: int, requests: int, acks: int) -> None:
    """Answer fsync requests until the request pipe closes."""
    while True:
        data = os.read(requests, 65536)  # whole 8-byte requests: each is one atomic pipe write
        if not data:
            return
        try:
            os.fsync(log)
            code = 0
        except OSError as exc:
            code = exc.errno or 5  # EIO when the platform gives no number
        os.write(acks, data[-8:] + code.to_bytes(4, "little"))


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group; the store, not the agent, decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(*(int(arg) for arg in sys.argv[1:4]))
