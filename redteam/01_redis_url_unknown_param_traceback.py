"""An unknown query parameter in a redis:// URL ends the CLI with a Python traceback and exit 1
(the "not found" code), instead of one line and exit 2 (bad usage), as docs/cli.md promises for
bad URLs ("an unknown URL scheme", "a parameter ... does not know" -> ConfigurationError, exit 2;
"never a traceback"). No server is needed: the TypeError comes from redis-py building the
connection. Exits 1 while the bug shows, 0 once fixed."""
import subprocess, sys, os

AS = os.path.join(os.path.dirname(sys.executable), "agenticstate")
bad = []
for url in ("redis://127.0.0.1:1/0?bogus=1", "unix:///tmp/nosuch.sock?bogus=1"):
    p = subprocess.run([AS, "--url", url, "keys"], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    if p.returncode != 2 or "Traceback" in p.stderr or len(lines) != 1:
        bad.append((url, p.returncode, lines[-1] if lines else ""))
for b in bad:
    print("BUG:", b)
sys.exit(1 if bad else 0)
