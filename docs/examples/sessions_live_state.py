"""agex's "live state across task calls", on agenticstate, with the blocking API.

In agex, `build_analysis([1, 2, 3], state=Live())` then `build_analysis([4, 5, 6], state=...)`
remembers the first call, and `Versioned()` also keeps that memory across processes. Here a task
is a plain (sync) function that takes a scoped view of the state: the memory backend gives
agex's `Live` (in this process), the file, SQLite or Redis backends give memory that survives the
process, and every write carries a version (agex's commits).

Install: `pip install .` (from a checkout; see the README).
"""

from pathlib import Path
from tempfile import TemporaryDirectory

from agenticstate import StateConfig, sync


def build_analysis(data: list[float], *, state: sync.ScopedState) -> dict[str, float]:
    """Build a cumulative analysis: each call adds its data to what earlier calls saw."""
    seen = state.update(
        "seen",
        lambda acc: {"count": acc["count"] + len(data), "total": acc["total"] + sum(data)},
        default={"count": 0, "total": 0.0},
    )
    result = {"count": seen["count"], "mean": seen["total"] / seen["count"]}
    state.save("last_result", result)
    return result


def main(directory: Path) -> None:
    # agex's Live(): state in this process only.
    with sync.StateManager() as live:
        shared_state = live.scope("analysis:")
        result1 = build_analysis([1, 2, 3], state=shared_state)
        result2 = build_analysis([4, 5, 6], state=shared_state)  # remembers result1
        assert result1 == {"count": 3, "mean": 2.0}
        assert result2 == {"count": 6, "mean": 3.5}
        print(shared_state.get_all())

    # agex's Versioned(Disk(...)): state that survives the process, one version per change.
    config = StateConfig(backend="file", file_path=str(directory / "agent.json"))
    with sync.StateManager(config) as store:
        build_analysis([1, 2, 3], state=store.scope("analysis:"))
    with sync.StateManager(config) as store:  # a later run
        shared_state = store.scope("analysis:")
        assert build_analysis([4, 5, 6], state=shared_state) == {"count": 6, "mean": 3.5}
        entry = shared_state.get_entry("seen")
        assert entry is not None
        assert entry.version == 2  # one version per task call
        print(f"seen at version {entry.version}: {entry.value}")


if __name__ == "__main__":
    with TemporaryDirectory() as tmp:
        main(Path(tmp))
