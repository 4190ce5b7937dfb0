"""One record under a manager's namespace that does not validate (written by another program
or a newer release: AgentCheckpoint has extra="forbid") blanks the whole tab: the inspector's
/api/agents (and /api/workflows, /api/knowledge, /api/tools, /api/sessions) answer 422 and
`agenticstate inspect agents` exits 2, so no valid agent is shown, and the error names neither
the key nor what to do ("DecodeError: stored value does not validate as AgentCheckpoint: 1
error(s)"). Expected: the valid records are listed, the bad one skipped or flagged with its
key. Exits 1 while the bug shows, 0 once fixed. About 3 s."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import httpx

from agenticstate import AgentCheckpoint, AgentStateStore, StateManager
from agenticstate.backends import open_backend
from agenticstate.ui import create_app

AS = os.path.join(os.path.dirname(sys.executable), "agenticstate")


async def main(url: str) -> list[str]:
    state = StateManager(backend=open_backend(url))
    await state.open()
    store = AgentStateStore(state_manager=state)
    await store.save_checkpoint(AgentCheckpoint(agent_id="writer", checkpoint_id="c0", step=1))
    # a record from a newer writer: one more field
    await state.save(
        "agents:{ghost}:checkpoints:c1",
        {"agent_id": "ghost", "checkpoint_id": "c1", "step": 0, "priority": 5},
    )
    bad = []
    app = create_app(state)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            r = await http.get("/api/agents")
            ids = [a["agent_id"] for a in r.json().get("agents", [])] if r.status_code == 200 else []
            if "writer" not in ids:
                bad.append(f"/api/agents -> {r.status_code} {r.text[:120]}")
    await state.aclose()
    return bad


with tempfile.TemporaryDirectory() as tmp:
    url = f"sqlite://{Path(tmp) / 's.db'}"
    problems = anyio.run(main, url)
    p = subprocess.run([AS, "--url", url, "inspect", "agents", "--json"], capture_output=True, text=True)
    if p.returncode != 0 or "writer" not in p.stdout:
        problems.append(f"inspect agents -> exit {p.returncode}: {p.stderr.strip()}")
for line in problems:
    print("BUG:", line)
sys.exit(1 if problems else 0)
