"""`agenticstate ui` on an unreachable Redis (a wrong port, a wrong password) does not fail:
it prints the inspector's address, serves a page that can read nothing, and logs
`ui_sample_failed error='BackendUnavailableError'` every 2 s without the reason. Every other
command exits 3 with one line naming the reason ("cannot reach Redis at ...: connection
refused"), as docs/cli.md's exit-code table says (3: the backend failed: unreachable), and `ui`
on a missing SQLite or file store exits 1 at once. Expected: exit 3 with that line, before
listening. Exits 1 while the bug shows, 0 once fixed. About 8 s."""
import os
import subprocess
import sys

AS = os.path.join(os.path.dirname(sys.executable), "agenticstate")
url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
try:
    p = subprocess.run([AS, "--url", url, "ui", "--port", "0"], capture_output=True, text=True, timeout=6)
    code, out, err = p.returncode, p.stdout, p.stderr
except subprocess.TimeoutExpired as exc:
    code, out, err = "still running after 6 s", exc.stdout, exc.stderr
    out = out.decode() if isinstance(out, bytes) else (out or "")
    err = err.decode() if isinstance(err, bytes) else (err or "")
print(f"exit: {code}\nstdout: {out.strip()!r}\nstderr: {err.strip()[:300]!r}")
sys.exit(0 if code == 3 and "connection refused" in err else 1)
