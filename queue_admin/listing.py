"""Changelist plumbing that stays fast on large tables.

Django's changelist counts the filtered rows (``COUNT(*)``) to paginate, and with
``show_full_result_count`` the whole table as well. On a queue with hundreds of thousands of
rows both are full scans. ``CappedPaginator`` counts at most ``COUNT_CAP`` rows, so a page
costs the same with ten thousand or ten million jobs; the templates show "10,000+" then.

The filters keep their lookups cheap: states and priorities are fixed choices (no query),
and the queue names come from one DISTINCT over the ``(queue, state, id)`` index, cached
briefly per process.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.cache import cache
from django.core.exceptions import BadRequest
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest
from django.utils.text import smart_split

from queue_core.conf import relay_settings
from queue_core.models import Job
from queue_core.states import JobState

COUNT_CAP = 10_000
# The lookups a field's list filter sends (Django's field list filters: a choice is
# ``field__exact``, "empty" ``field__isnull`` or ``field__isempty``).
FILTER_LOOKUPS = frozenset({"exact", "isnull", "isempty", "id__exact"})
# Terms in a changelist search (each an OR of LIKEs that scan the table: 31 that matched every
# job and one that matched none took 2 s a request at 200,000 jobs; a review).
MAX_SEARCH_TERMS = 8
# A row by its primary key, in a list's query string (``?id=job_...``): an index seek.
ID_LOOKUPS = frozenset({"id", "id__exact", "pk"})


def declared_lookup(lookup: str, list_filter: Iterable[Any]) -> bool:
    """Whether ``lookup`` (a changelist query-string key) is one a declared list filter sends:
    a ``SimpleListFilter``'s ``parameter_name``, or a filtered field with one of
    ``FILTER_LOOKUPS``.

    Django lets a changelist's query string filter on any lookup of the model's own fields,
    whatever the filters: a user who may only view jobs sent ``?payload__regex=(y+)+x``,
    which SQLite runs in Python under its lock (60 s, every HTTP request stalled, the worker
    killed by gunicorn's timeout; a review), ``?id__regex=(`` answered 500, and
    ``?secret_sha256__startswith=`` read an API key's hash in 511 requests.
    """
    field, _, suffix = lookup.partition(LOOKUP_SEP)
    for item in list_filter:
        if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
            if lookup == item.parameter_name:
                return True
            continue
        name = item[0] if isinstance(item, tuple | list) else item
        if field == name and (suffix in FILTER_LOOKUPS):
            return True
    return False


if TYPE_CHECKING:
    _AdminBase = admin.ModelAdmin[Any]
else:  # ModelAdmin is generic only in django-stubs
    _AdminBase = admin.ModelAdmin


class BoundedChangelist(_AdminBase):
    """A model admin whose list takes, in its query string, only its declared filters'
    lookups (``declared_lookup``) and a primary key (``ID_LOOKUPS``), any other 400 Bad
    Request; and a search of at most ``MAX_SEARCH_TERMS`` terms (as Django splits them,
    quoted phrases whole), more 400 too (1,000 answered 500, "Expression tree is too large").
    Relay's admins use it, and the standalone console's users and groups
    (``relayproject.auth_admin``)."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """See the class docstring."""
        return lookup in ID_LOOKUPS or declared_lookup(lookup, self.get_list_filter(request))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """Django's search, refused past ``MAX_SEARCH_TERMS`` terms.

        Raises:
            BadRequest: too many terms.
        """
        if len(list(smart_split(search_term))) > MAX_SEARCH_TERMS:
            raise BadRequest(f"a search takes at most {MAX_SEARCH_TERMS} terms")
        return super().get_search_results(request, queryset, search_term)


QUEUE_CHOICES_CACHE_KEY = "relay-admin:queue-names"
QUEUE_CHOICES_TTL_S = 30
MAX_QUEUE_CHOICES = 200


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """A paginator that counts at most ``COUNT_CAP`` rows.

    ``count`` runs ``SELECT COUNT(*) FROM (SELECT id ... LIMIT cap + 1)``: an index walk that
    stops after ``cap + 1`` rows instead of a full scan. ``capped`` tells templates that there
    are more rows than ``count`` says.
    """

    cap = COUNT_CAP

    @cached_property
    def count(self) -> int:
        """Rows in the list, at most ``cap``."""
        qs = self.object_list
        if isinstance(qs, QuerySet):
            n = qs.order_by().values("pk")[: self.cap + 1].count()
        else:  # pragma: no cover - the admin always passes a QuerySet
            n = len(qs)
        self.capped = n > self.cap
        return min(n, self.cap)

    capped = False


class JobChangeList(ChangeList):
    """The changelist without the payload column (payloads may be 256 KiB each)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        """The filtered, searched, ordered jobs, minus their payloads."""
        return super().get_queryset(request, exclude_parameters).defer("payload")

    def get_results(self, request: HttpRequest) -> None:
        """Fetch the page; a list that fits one page still gets a LIMIT.

        Django reads a single-page list unsliced. A LIMIT changes nothing there (the count
        said it fits) but lets SQLite prefer a small partial index over walking every job
        in id order, e.g. for the few leased jobs.
        """
        super().get_results(request)
        rows = self.result_list
        if isinstance(rows, QuerySet) and not rows.query.is_sliced:
            self.result_list = rows[: max(self.list_max_show_all, self.list_per_page)]


def queue_names() -> list[str]:
    """Every queue with at least one job, cached for ``QUEUE_CHOICES_TTL_S`` per process.

    One DISTINCT over the ``relay_job_queue_state`` covering index (a few ms at 200,000
    jobs); the cache keeps repeated changelist renders from paying it each time.
    """
    names: list[str] | None = cache.get(QUEUE_CHOICES_CACHE_KEY)
    if names is None:
        names = list(
            Job.objects.using(relay_settings().database)
            .order_by("queue")
            .values_list("queue", flat=True)
            .distinct()[:MAX_QUEUE_CHOICES]
        )
        cache.set(QUEUE_CHOICES_CACHE_KEY, names, QUEUE_CHOICES_TTL_S)
    return names


class QueueFilter(admin.SimpleListFilter):
    """Filter by queue; the choices come from ``queue_names()``."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        """The known queue names."""
        names = queue_names()
        chosen = self.value()
        if chosen and chosen not in names:
            names = [*names, chosen]  # still show what the URL asks for
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Jobs of the chosen queue."""
        value = self.value()
        return queryset.filter(queue=value) if value else queryset


class StateFilter(admin.SimpleListFilter):
    """Filter by state, steering SQLite to the partial index that holds that state."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        """The six states, in life order."""
        return [(s.value, s.value) for s in JobState]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Jobs in the chosen state."""
        value = self.value()
        if not value:
            return queryset
        if value not in JobState:  # no job has it: a scan of every job would find none
            return queryset.none()
        queryset = queryset.filter(state=value)
        if value == JobState.LEASED:
            # Always true for a leased row (its expiry is an epoch ms), but the range lets
            # the planner use the small relay_job_leased partial index instead of walking
            # every job by id.
            queryset = queryset.filter(lease_expires_at_ms__gte=0)
        return queryset
