"""Tool state: a cached call run once for many callers, a flaky call retried, the stats.

Install: `pip install .` (from a checkout; see the README).
"""

import logging

import anyio

from agenticstate import ToolStateManager


async def main() -> None:
    # The library logs through `logging`; show its warnings as labelled lines.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    async with ToolStateManager(persistence="memory", cache_results=True, cache_ttl=3600) as tools:
        runs = 0

        async def search() -> dict:
            nonlocal runs
            runs += 1
            await anyio.sleep(0.05)  # a slow web search
            return {"results": ["agenticstate", "anyio"]}

        results = []

        async def ask() -> None:
            results.append(await tools.cached_call("search_web", {"query": "AI news"}, search))

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(ask)
        print(f"10 identical calls, the tool ran {runs} time(s)")
        assert runs == 1
        assert len(results) == 10

        attempts = 0

        async def flaky_fetch() -> str:
            nonlocal attempts
            attempts += 1
            if attempts < 3:
                raise TimeoutError("upstream slow")
            return "page"

        print("the fetch times out on purpose twice; each failure schedules a retry")
        page = await tools.run_with_retries(
            "fetch-1",
            "fetch_page",
            {"url": "https://example.org"},
            flaky_fetch,
            max_attempts=5,
            base_delay=0.01,
            backoff_factor=2.0,
        )
        print(f"fetched {page!r} after {attempts} attempts")

        for name in ("search_web", "fetch_page"):
            stats = await tools.get_tool_stats(name)
            print(
                f"{name}: {stats.total_executions} runs, success {stats.success_rate:.0%}, "
                f"cache hits {stats.cache_hit_rate:.0%}, p95 {stats.p95_duration_ms:.1f} ms"
            )
        assert (await tools.get_tool_stats("fetch_page")).failed_executions == 2


if __name__ == "__main__":
    anyio.run(main)
