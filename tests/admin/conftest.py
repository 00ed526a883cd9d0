"""Fixtures for the operator console: operators with and without permissions, logged-in
clients, and dead letters made through the service."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.cache import cache
from django.test import Client

from queue_admin.admin import JobAdmin
from queue_core.clock import FakeClock

Factory = Callable[..., dict[str, Any]]


@pytest.fixture(autouse=True)
def _fresh_queue_names() -> Iterator[None]:
    """The queue filter caches queue names; each test starts without them."""
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def console_clock(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Make the console read the same fake clock as the service fixture."""
    monkeypatch.setattr(JobAdmin, "clock", clock)
    return clock


def make_operator(username: str, *codenames: str) -> User:
    """A staff user holding exactly these ``queue_core`` permissions."""
    user = User.objects.create_user(username, is_staff=True)  # force_login: no password
    perms = Permission.objects.filter(content_type__app_label="queue_core", codename__in=codenames)
    assert perms.count() == len(codenames), codenames
    user.user_permissions.add(*perms)
    return user


OPERATOR_PERMS = ("view_job", "view_deadletter", "view_jobevent", "replay_job", "purge_job")


@pytest.fixture
def operator(transactional_db: None) -> User:
    """A staff operator with view, replay and purge permissions (not a superuser)."""
    return make_operator("alice", *OPERATOR_PERMS)


@pytest.fixture
def alice(operator: User) -> Client:
    """A client logged in as the operator ``alice``."""
    client = Client()
    client.force_login(operator)
    return client


@pytest.fixture
def bob(transactional_db: None) -> Client:
    """A second operator, ``bob``, with the same permissions."""
    client = Client()
    client.force_login(make_operator("bob", *OPERATOR_PERMS))
    return client


@pytest.fixture
def dead_jobs(dead_job: Factory) -> Callable[..., list[str]]:
    """``dead_jobs(n, queue="email", error="boom") -> [job ids]`` in id order."""

    def make(n: int, queue: str = "email", error: str = "boom", **options: Any) -> list[str]:
        return [dead_job(queue=queue, error=error, **options)["id"] for _ in range(n)]

    return make


DEAD_LIST = "/admin/queue_core/deadletter/"
JOB_LIST = "/admin/queue_core/job/"
OVERVIEW = "/admin/queue_core/job/overview/"


def job_url(job_id: str) -> str:
    """The job's read-only detail page."""
    return f"/admin/queue_core/job/{job_id}/change/"


def messages_of(response: Any) -> list[str]:
    """The flash messages a followed response shows."""
    return [str(m) for m in response.context["messages"]]
