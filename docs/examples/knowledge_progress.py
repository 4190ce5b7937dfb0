"""Parallel indexers report progress; the overview and the ETA come from the stored state.

Install: `pip install .` (from a checkout; see the README).
"""

import anyio

from agenticstate import (
    IndexingProgress,
    IndexingStatus,
    KnowledgeStateManager,
    SourceState,
    SyncStatus,
)


async def main() -> None:
    async with KnowledgeStateManager(persistence="memory") as kb_state:
        await kb_state.update_indexing_progress(
            IndexingProgress(knowledge_base_id="company_docs", total_documents=400)
        )
        await kb_state.update_source_state(
            SourceState(
                source_id="confluence_docs",
                knowledge_base_id="company_docs",
                sync_status=SyncStatus.SYNCED,
                documents_synced=400,
                embeddings_count=1600,
                storage_bytes=12 * 1024 * 1024,
            )
        )

        async def indexer(batch: int) -> None:
            for _ in range(batch):
                await kb_state.increment_progress("company_docs", processed=1, embeddings=4)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(indexer, 100)

        progress = await kb_state.get_indexing_progress("company_docs")
        estimate = await kb_state.estimate("company_docs")
        overview = await kb_state.get_knowledge_base_state("company_docs")
        print(f"{progress.processed_documents}/{progress.total_documents} ({progress.status})")
        print(f"throughput: {estimate.documents_per_second} docs/s, eta: {estimate.eta}")
        print(
            f"{overview.total_documents} documents, {overview.total_embeddings} embeddings, "
            f"{overview.storage_size_mb} MB"
        )
        assert progress.processed_documents == 400
        assert progress.status is IndexingStatus.COMPLETED
        assert overview.total_embeddings == 1600


if __name__ == "__main__":
    anyio.run(main)
