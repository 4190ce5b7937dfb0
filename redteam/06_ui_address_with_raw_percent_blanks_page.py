"""An inspector address whose item holds a bare '%' (typed or pasted by hand: #/keys/100%)
throws URIError in parseHash's decodeURIComponent, so follow() never runs: the key list stays
empty and no tab loads, with no message (docs/inspector.md: every view has an address; a
link shows a colleague exactly what you see). Expected: the page loads (the key list shows),
the malformed item ignored or taken literally. Needs chromium. Starts `agenticstate ui` on a
SQLite store with one key and dumps the DOM of two addresses. Exits 1 while the bug shows,
0 once fixed. About 15 s."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

AS = os.path.join(os.path.dirname(sys.executable), "agenticstate")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def dom(url: str) -> str:
    p = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         "--dump-dom", url], capture_output=True, text=True, timeout=90)
    return p.stdout


with tempfile.TemporaryDirectory() as tmp:
    url = f"sqlite://{tmp}/s.db"
    subprocess.run([AS, "--url", url, "set", "visible:key", "1"], check=True, capture_output=True)
    ui = subprocess.Popen([AS, "--url", url, "ui", "--port", "0", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = json.loads(ui.stdout.readline())["address"]
        good = dom(address + "#/keys/visible%3Akey")
        bad = dom(address + "#/keys/100%")
    finally:
        ui.terminate()
        ui.wait(10)
ok_good = "visible:key" in good
ok_bad = "visible:key" in bad
print(f"#/keys/visible%3Akey lists the key: {ok_good}; #/keys/100% lists the key: {ok_bad}")
sys.exit(0 if ok_good and ok_bad else 1)
