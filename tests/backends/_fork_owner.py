"""An owner process for the fork tests: `python -m tests.backends._fork_owner DIR MODE FORMAT`.

It opens a FileBackend (fsync durability), acknowledges the key `owner`, prints `acked`, then
starts children that inherit the open store:

- `fork`: one `os.fork()` child. The child reports whether its copies of the store's
  descriptors are closed (`child-fds closed|open`) and what the store says when it writes
  (`child-write <message>`), then lives until stdin closes. The owner closes the store and
  prints `closed <agent exit code>`, then waits for stdin to close.
- `pool`: a `multiprocessing` pool (fork start method) of two live workers; the owner closes the
  store, prints `closed <agent exit code>` and ends the pool.
- `hold`: one `os.fork()` child as in `fork`; the owner prints `ready` and waits to be killed.
- `rawfork`: a child forked by libc's `fork()` directly, so Python's fork hooks never run and it
  keeps every inherited descriptor; it lives until stdin closes. The owner closes the store and
  prints `closed <agent exit code>` (the agent is killed after the grace period).

Before the children start, it prints `children PID...`.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys

import anyio

from agenticstate import BackendError, FileBackend


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def child(backend: FileBackend, fds: list[int]) -> None:
    """In the forked child: check the store is disowned, then live until stdin closes."""
    closed = True
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        closed = False
    emit(f"child-fds {'closed' if closed else 'open'}")
    # No event loop in the child (the parent's is not ours, and a child forked from a threaded
    # process should do little): the store refuses before its first suspension point.
    write = backend.set("child", b"\x02" + b'"from the child"')
    try:
        write.send(None)
    except BackendError as exc:
        emit(f"child-write {exc}")
    else:
        write.close()
        emit("child-write accepted")
    sys.stdin.buffer.read()
    os._exit(0)


def worker_pid(_: int) -> int:
    return os.getpid()


async def main(directory: str, mode: str, fmt: str) -> None:
    backend = FileBackend(base_path=directory, format=fmt)  # type: ignore[arg-type]
    await backend.open()
    await backend.set("owner", b"\x02" + b'"acked"')
    emit("acked")
    agent = backend._commit_log.agent
    assert agent is not None
    owned = (backend._lock.fd, backend._commit_log.fd, agent.requests)
    fds = [fd for fd in owned if fd is not None]
    pool = None
    if mode == "pool":
        pool = multiprocessing.get_context("fork").Pool(2)
        pids = set(pool.map(worker_pid, range(8)))
        emit("children " + " ".join(str(pid) for pid in sorted(pids)))
    elif mode == "rawfork":
        pid = ctypes.CDLL(None, use_errno=True).fork()
        if pid == 0:  # no hooks ran: hold everything, do as little as possible
            os.read(0, 1)
            os._exit(0)
        emit(f"children {pid}")
    else:
        pid = os.fork()
        if pid == 0:
            child(backend, fds)
        emit(f"children {pid}")
    if mode == "hold":
        emit("ready")
        await anyio.sleep_forever()
    await backend.aclose()
    emit(f"closed {agent.process.returncode}")
    if pool is not None:
        pool.terminate()
        pool.join()
    else:
        await anyio.to_thread.run_sync(sys.stdin.buffer.read)
        if mode == "rawfork":
            await anyio.to_thread.run_sync(os.waitpid, pid, 0)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
