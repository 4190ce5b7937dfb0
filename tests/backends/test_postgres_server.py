"""The test suite's private PostgreSQL cluster starts, serves and stops by its pid."""

from __future__ import annotations

import psycopg


def test_session_server_serves_sql(postgres_url: str) -> None:
    """The session's server answers a query over its unix socket."""
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None
    assert row[0] >= 150000
