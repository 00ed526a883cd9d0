"""Fixtures for the hypothesis tests: one test database shared by many examples."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection


@pytest.fixture
def fast_commits(transactional_db: None) -> Iterator[None]:
    """Skip the fsync per commit on this test's connection (durability is not under test
    here, and hundreds of examples each commit many times); restored afterwards."""
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA synchronous=OFF")
    yield
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA synchronous=FULL")
