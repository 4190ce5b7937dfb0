"""A plain `sqlite3` process holding a lock on a database, for the lock-wait and WAL tests.

python -m tests.integration._sqlite_lock DB write
    take the write lock (`BEGIN IMMEDIATE`), print "locked", hold it until stdin closes
python -m tests.integration._sqlite_lock DB read
    open a read transaction on the `kv` table (a snapshot the WAL cannot be checkpointed past),
    print "reading", hold it until stdin closes
"""

from __future__ import annotations

import sqlite3
import sys


def main(path: str, mode: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    if mode == "write":
        conn.execute("BEGIN IMMEDIATE")
        sys.stdout.write("locked\n")
    else:
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM kv").fetchone()
        sys.stdout.write("reading\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the test closes our stdin
    conn.execute("ROLLBACK")
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
