"""An fsync agent for the fault tests: it answers the first N requests with an error.

`AGENTICSTATE_TEST_FAILING_FSYNCS` sets N (default 1) and `AGENTICSTATE_TEST_FSYNC_ERRNO` the
error's name (default ENOSPC); after those, it fsyncs for real, like `_fsync_agent`.
"""

import errno
import os
import sys

failures = int(os.environ.get("AGENTICSTATE_TEST_FAILING_FSYNCS", "1"))
code = getattr(errno, os.environ.get("AGENTICSTATE_TEST_FSYNC_ERRNO", "ENOSPC"))
log, requests, acks = (int(arg) for arg in sys.argv[1:4])
while data := os.read(requests, 65536):
    if failures > 0:
        failures -= 1
        result = code
    else:
        os.fsync(log)
        result = 0
    os.write(acks, data[-8:] + result.to_bytes(4, "little"))
