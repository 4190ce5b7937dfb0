"""A reader that goes away early ends `agenticstate keys` with exit 141 (docs/cli.md: "A reader
that goes away early ... ends the command quietly, with exit code 141"), but `keys --json`
(one large write) exits 0 though most of its output was never delivered, so a pipeline
cannot tell a cut-off listing from a complete one. (Plain CPython loses the EPIPE of a large
partial write the same way; the CLI would need to write in pieces or check.) Exits 1 while
the bug shows, 0 once fixed. About 5 s."""
import os
import subprocess
import sys
import tempfile

import anyio

from agenticstate import StateManager
from agenticstate.backends import open_backend

AS = os.path.join(os.path.dirname(sys.executable), "agenticstate")


async def fill(url: str) -> None:
    state = StateManager(backend=open_backend(url))
    await state.open()
    await state.save_many({f"k:{i:06d}:" + "x" * 40: i for i in range(20000)})
    await state.aclose()


codes = {}
with tempfile.TemporaryDirectory() as tmp:
    url = f"sqlite://{tmp}/s.db"
    anyio.run(fill, url)
    for args in (["keys"], ["keys", "--json"]):
        p = subprocess.Popen([AS, "--url", url, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        p.stdout.read(1)
        p.stdout.close()
        codes[" ".join(args)] = p.wait(60)
print(codes, "(expected 141 for both)")
sys.exit(0 if all(c == 141 for c in codes.values()) else 1)
