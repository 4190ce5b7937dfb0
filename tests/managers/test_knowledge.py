"""KnowledgeStateManager on every backend: progress, increments, sources, the overview."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import (
    IndexingProgress,
    IndexingStatus,
    InvalidArgumentError,
    InvalidTransitionError,
    KnowledgeStateManager,
    NotFoundError,
    SourceState,
    StateManager,
    SyncStatus,
)
from agenticstate.managers.knowledge import MAX_SAMPLES


@pytest.fixture
def kb_state(state: StateManager) -> KnowledgeStateManager:
    return KnowledgeStateManager(state_manager=state)


async def test_seed_knowledge_examples(kb_state: KnowledgeStateManager) -> None:
    """The seed page's indexing, source and overview examples, as written."""
    progress = IndexingProgress(
        knowledge_base_id="company_docs",
        status=IndexingStatus.IN_PROGRESS,
        total_documents=1000,
        processed_documents=450,
        failed_documents=5,
        started_at=datetime.now(),  # noqa: DTZ005  # the seed page's own call
    )
    await kb_state.update_indexing_progress(progress)
    current = await kb_state.get_indexing_progress("company_docs")
    assert current is not None
    assert (current.processed_documents, current.total_documents, current.failed_documents) == (
        450,
        1000,
        5,
    )
    assert current.started_at == progress.started_at

    source_state = SourceState(
        source_id="confluence_docs",
        knowledge_base_id="company_docs",
        sync_status=SyncStatus.SYNCING,
        last_sync=datetime.now() - timedelta(hours=1),  # noqa: DTZ005
        documents_synced=250,
        documents_pending=50,
    )
    await kb_state.update_source_state(source_state)
    sources = await kb_state.get_sources("company_docs")
    assert [(s.source_id, s.sync_status) for s in sources] == [
        ("confluence_docs", SyncStatus.SYNCING)
    ]

    kb_overview = await kb_state.get_knowledge_base_state("company_docs")
    assert kb_overview.total_documents == 450  # indexing processed more than the source synced
    assert kb_overview.documents_pending == 50
    assert kb_overview.last_updated is not None
    assert kb_overview.sync_status is SyncStatus.SYNCING
    assert kb_overview.storage_size_mb == 0.0


async def test_parallel_increments_lose_nothing(kb_state: KnowledgeStateManager) -> None:
    """20 concurrent indexers x 25 increments: counts are exact and the run completes."""
    await kb_state.update_indexing_progress(
        IndexingProgress(knowledge_base_id="kb", total_documents=500)
    )

    async def indexer(n: int) -> None:
        for i in range(25):
            failed = 1 if (n + i) % 10 == 0 else 0
            await kb_state.increment_progress(
                "kb", processed=1 - failed, failed=failed, embeddings=3, bytes_indexed=1024
            )

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(indexer, n)
    progress = await kb_state.get_indexing_progress("kb")
    assert progress is not None
    assert progress.processed_documents + progress.failed_documents == 500
    assert progress.failed_documents == 50
    assert progress.embeddings_generated == 1500
    assert progress.status is IndexingStatus.COMPLETED
    assert progress.completed_at is not None
    assert len(progress.samples) <= 120


async def test_estimate_from_samples(kb_state: KnowledgeStateManager) -> None:
    """Throughput and ETA come from the progress history."""
    await kb_state.update_indexing_progress(
        IndexingProgress(knowledge_base_id="kb", total_documents=100)
    )
    empty = await kb_state.estimate("kb")
    assert empty.documents_per_second is None
    assert empty.eta is None
    for _ in range(3):
        await kb_state.increment_progress("kb", processed=10)
        await anyio.sleep(0.02)  # samples need time between them to give a rate
    estimate = await kb_state.estimate("kb")
    assert estimate.documents_per_second is not None
    assert estimate.documents_per_second > 0
    assert estimate.remaining_documents == 70
    assert estimate.eta is not None
    assert estimate.percent == pytest.approx(0.3)


async def test_overview_aggregates_sources(kb_state: KnowledgeStateManager) -> None:
    """Documents, embeddings and storage add up over sources; the worst sync status wins."""
    when = datetime(2026, 1, 1, tzinfo=UTC)
    for n, status in enumerate([SyncStatus.SYNCED, SyncStatus.FAILED, SyncStatus.SYNCING]):
        await kb_state.update_source_state(
            SourceState(
                source_id=f"s{n}",
                knowledge_base_id="kb",
                sync_status=status,
                last_sync=when + timedelta(hours=n),
                documents_synced=100,
                embeddings_count=400,
                storage_bytes=1024 * 1024,
            )
        )
    overview = await kb_state.get_knowledge_base_state("kb")
    assert overview.total_documents == 300
    assert overview.total_embeddings == 1200
    assert overview.storage_size_mb == 3.0
    assert overview.sync_status is SyncStatus.FAILED
    assert overview.last_updated == when + timedelta(hours=2)
    assert overview.indexing_status is None
    assert await kb_state.list_knowledge_bases() == ["kb"]
    assert await kb_state.remove_source("kb", "s1") is True
    assert (await kb_state.get_knowledge_base_state("kb")).sync_status is SyncStatus.SYNCING


async def test_errors(kb_state: KnowledgeStateManager) -> None:
    """Unknown knowledge bases raise NotFoundError; negative increments are refused."""
    with pytest.raises(NotFoundError):
        await kb_state.get_knowledge_base_state("nope")
    with pytest.raises(NotFoundError):
        await kb_state.increment_progress("nope", processed=1)
    with pytest.raises(NotFoundError):
        await kb_state.estimate("nope")
    await kb_state.update_indexing_progress(IndexingProgress(knowledge_base_id="kb"))
    with pytest.raises(InvalidArgumentError):
        await kb_state.increment_progress("kb", processed=-1)
    progress = await kb_state.get_indexing_progress("kb")
    assert progress is not None
    assert progress.processed_documents == 0


async def test_delete_knowledge_base(kb_state: KnowledgeStateManager) -> None:
    """delete_knowledge_base removes the progress record and every source, and no other
    knowledge base's; an unknown id raises NotFoundError."""
    await kb_state.update_indexing_progress(
        IndexingProgress(knowledge_base_id="kb*", total_documents=10)
    )
    for source_id in ("s1", "s2"):
        await kb_state.update_source_state(
            SourceState(source_id=source_id, knowledge_base_id="kb*")
        )
    await kb_state.update_source_state(SourceState(source_id="s1", knowledge_base_id="kb2"))
    assert await kb_state.delete_knowledge_base("kb*") == 3
    assert await kb_state.get_indexing_progress("kb*") is None
    assert await kb_state.get_sources("kb*") == []
    assert await kb_state.list_knowledge_bases() == ["kb2"]
    with pytest.raises(NotFoundError):
        await kb_state.get_knowledge_base_state("kb*")
    with pytest.raises(NotFoundError):
        await kb_state.increment_progress("kb*", processed=1)
    with pytest.raises(NotFoundError):
        await kb_state.delete_knowledge_base("kb*")
    assert await kb_state.delete_knowledge_base("kb2") == 1
    assert await kb_state.state.list_keys("knowledge:*") == []


async def test_a_new_run_never_mixes_in_the_last_runs_samples() -> None:
    """Whatever sequence of runs, reports and increments, estimate's rate is never negative
    and its eta never before now: a new run starts its own samples."""
    steps = st.lists(
        st.one_of(
            st.tuples(st.just("new run"), st.integers(0, 2000), st.integers(1, 1000)),
            st.tuples(st.just("increment"), st.integers(0, 400), st.integers(0, 3)),
            # enough increments that the oldest samples left are this run's
            st.tuples(st.just("many"), st.integers(0, 5), st.just(0)),
        ),
        max_size=12,
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(steps)
    def check(plan: list[tuple[str, int, int]]) -> None:
        async def run() -> None:
            kb = KnowledgeStateManager()
            await kb.update_indexing_progress(
                IndexingProgress(knowledge_base_id="kb", total_documents=500)
            )
            for kind, amount, other in plan:
                if kind == "new run":
                    await kb.update_indexing_progress(
                        IndexingProgress(
                            knowledge_base_id="kb",
                            total_documents=amount + other,
                            processed_documents=amount,
                        )
                    )
                else:
                    for _ in range(MAX_SAMPLES + 1 if kind == "many" else 1):
                        with contextlib.suppress(InvalidTransitionError):
                            await kb.increment_progress("kb", processed=amount, failed=other)
                estimate = await kb.estimate("kb")
                rate = estimate.documents_per_second
                assert rate is None or rate >= 0
                assert estimate.eta is None or estimate.eta >= timedelta(0)

        anyio.run(run)

    await anyio.to_thread.run_sync(check)
