"""One job shape: ``job_view`` builds ``types.Job``, and the SQL that feeds it selects exactly
the columns it reads (``JOB_COLUMNS``), in both drivers."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from queue_core import jobs, types
from queue_core.storage.base import load_queries
from tests.typeddicts import typed_keys

DRIVERS = ["queue_core.storage.sqlite", "queue_core.storage.postgresql"]


class Recording(Mapping[str, Any]):
    """A row that records which columns are read."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self.row[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.row)

    def __len__(self) -> int:
        return len(self.row)


def _row() -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(jobs.JOB_COLUMNS)
    row.update(priority=1, payload=b'{"a":1}', jitter=1, id="job_1", attempt=0)
    return row


def test_job_view_reads_exactly_the_job_columns() -> None:
    row = Recording(_row())
    jobs.job_view(row)
    assert row.read == set(jobs.JOB_COLUMNS)


def test_job_view_builds_every_required_key_of_types_job() -> None:
    view = jobs.job_view(_row())
    assert set(view) == typed_keys(types.Job, required=True)
    assert typed_keys(types.Job, required=False) == {"history", "events", "history_omitted"}
    assert view["priority"] == "normal" and view["payload"] == {"a": 1}
    assert view["retry_policy"]["jitter"] is True


def test_a_new_job_view_is_the_view_of_its_row() -> None:
    row = {k: v for k, v in _row().items() if k not in jobs._FRESH and k != "created_at_ms"}
    fresh = jobs.new_job_view(row, created_at_ms=5, payload={"a": 1})
    assert fresh == jobs.job_view({**_row(), **jobs._FRESH, "created_at_ms": 5})


@pytest.mark.parametrize("package", DRIVERS)
@pytest.mark.parametrize("name", ["get_job", "dead_page", "jobs_page"])
def test_job_selects_list_the_job_columns(package: str, name: str) -> None:
    statement = load_queries(package)[name]
    selected = re.match(r"SELECT (.*?)\s+FROM relay_job\b", statement, re.S)
    assert selected is not None, statement
    assert [c.strip() for c in selected.group(1).split(",")] == list(jobs.JOB_COLUMNS)


@pytest.mark.parametrize("package", DRIVERS)
def test_no_placeholder_is_left_in_any_statement(package: str) -> None:
    for name, statement in load_queries(package).items():
        assert "{" not in statement, name
