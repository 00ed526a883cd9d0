"""The operator console: jobs, dead letters, the audit log and the queue overview.

No side doors: every list and detail page here is read-only (no add, change or delete), and
the only writes are the replay, purge and cancel actions, which call ``QueueService`` per job
with the operator's username as the actor, so each job's events say who did it and when, the
queue controls on the overview (pause, resume, limits: ``QueueService.pause`` / ``resume`` /
``set_queue_limits``, each behind a confirmation page and its permission, recorded in the
audit log as ``queue:<name>`` events) and the Maintenance page (prune, backup:
``queue_admin.maintenance``). Each
action shows a confirmation page (like Django's ``delete_selected``) that states how many
jobs it will touch; on the dead-letter list the same actions also apply to everything that
matches the current filters.

The pages register on the project's ``admin.site`` and change nothing else about it: the
branded console (header, home page with the overview first) is the standalone service's own
site, ``relayproject.admin.RelayAdminSite``. Elsewhere the overview is linked from the job list.

Lists stay fast on large tables: the row count is capped (``CappedPaginator``), the
unfiltered total is never counted, payloads are not loaded, and no column runs a query per
row.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import urlencode

import orjson
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import BadRequest, PermissionDenied
from django.db.models import Count, QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from queue_admin import display, maintenance
from queue_admin.listing import (
    BoundedChangelist,
    CappedPaginator,
    JobChangeList,
    QueueFilter,
    StateFilter,
)
from queue_admin.operations import CHUNK, BulkRunner, Op, describe
from queue_admin.overview import build_overview
from queue_core.clock import Clock
from queue_core.conf import relay_settings
from queue_core.errors import InvalidArgument, RelayError
from queue_core.models import DeadLetter, Job, JobAttempt, JobEvent, JobResult
from queue_core.service import QueueService, default_clock
from queue_core.states import WAITING_STATES, JobState, Priority
from queue_core.storage import driver_for
from queue_core.worker.handlers import is_django_task

JOB_ID_RE = re.compile(r"job_[0-9A-Za-z]{1,36}")
# The states a cancel applies to: waiting ones (cancelled at once) and leased ones (marked).
CANCELLABLE = (*sorted(WAITING_STATES), JobState.LEASED)
SAMPLE_IDS = 20
# A job's page shows at most this many of its latest attempts, and of its latest events:
# replays reset the retry budget, so one job's history has no bound (3,000 fail-and-replay
# rounds made a 13.6 MB page; a review). The audit log pages through every event.
HISTORY_ROWS = 100
# Query parameters of the changelist that do not narrow which jobs match.
NON_FILTER_PARAMS = frozenset({"p", "o", "all", "e", "_facets"})

# Columns whose values are credentials: a lease's token settles its job (ack, fail, release).
SECRET_FIELDS = frozenset({"lease_token"})


class ReadOnlyAdmin(BoundedChangelist):
    """Lists and detail pages without add, change or delete, sized for large tables."""

    paginator = CappedPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    empty_value_display = display.DASH
    list_per_page = 100
    list_max_show_all = 200

    class Media:
        css: ClassVar[dict[str, list[str]]] = {"all": ["queue_admin/relay.css"]}

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """Rows of Relay's database (``RELAY_DATABASE``), not Django's default alias (a
        structural audit: with another alias the console showed another database's jobs)."""
        return super().get_queryset(request).using(relay_settings().database)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Jobs are created by producers, never in the console."""
        return False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """Those of ``BoundedChangelist``, never one on a ``SECRET_FIELDS`` column: with it,
        a user who may only view jobs read a live lease's token a character at a time
        (``?lease_token__gte=...``: a review recovered one in 257 requests and acked the job
        with another worker key)."""
        if any(part in SECRET_FIELDS for part in lookup.split(LOOKUP_SEP)):
            return False
        return super().lookup_allowed(lookup, value, request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Job state changes only through the replay and purge actions."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Deleting is the purge action, through the service."""
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """Every job: filters, search, and a read-only detail page with its history."""

    clock: Clock | None = None  # None: the service's own (the database's time on PostgreSQL)
    # Purge from this list takes any finished job (SUCCEEDED or DEAD).
    purge_dead_only = False
    noun = "job"
    list_title = "Jobs"

    list_display: tuple[str, ...] = (
        "id",
        "queue",
        "state_badge",
        "priority_name",
        "attempt",
        "failures_of",
        "age",
        "short_error",
        "lease_holder",
    )
    list_filter: ClassVar[tuple[Any, ...]] = (QueueFilter, StateFilter, "priority")
    search_fields = ("=id", "=idempotency_key", "last_error")
    search_help_text = "A job id, an idempotency key, or words from the last error."
    ordering = ("-id",)
    sortable_by = ("id",)
    actions: tuple[str, ...] = ("replay_selected", "purge_selected", "cancel_selected")
    fieldsets = (
        (None, {"fields": ("id", "queue", "state", "priority_name", "idempotency")}),
        ("Payload", {"fields": ("payload_pretty", "meta_pretty")}),
        (
            "Retries",
            {
                "fields": (
                    "retry_policy",
                    "attempt",
                    "failures_of",
                    "last_error_full",
                    "dead_reason",
                )
            },
        ),
        (
            "Lease",
            {"fields": ("leased_by", "lease_times", "token_status", "time_limit", "cancel")},
        ),
        ("Timestamps", {"fields": ("created", "available", "ready_since", "updated", "finished")}),
        ("Result", {"fields": ("result_status", "return_value", "result_errors")}),
        ("History", {"fields": ("history",)}),
    )
    readonly_fields = (
        "priority_name",
        "idempotency",
        "payload_pretty",
        "meta_pretty",
        "retry_policy",
        "failures_of",
        "last_error_full",
        "lease_times",
        "token_status",
        "time_limit",
        "cancel",
        "created",
        "available",
        "ready_since",
        "updated",
        "finished",
        "result_status",
        "return_value",
        "result_errors",
        "history",
    )

    # ----------------------------------------------------------------- plumbing

    def service(self) -> QueueService:
        """The service the console reads through and writes with, on the clock every service
        of the process keeps (``default_clock``; a structural audit: a ``SystemClock`` of the
        console's own judged and stamped instants by the web host's clock on PostgreSQL)."""
        return QueueService(clock=self.clock)

    def now_ms(self) -> int:
        """The console's current time, epoch ms (the service's clock)."""
        clock = self.clock or default_clock(driver_for(relay_settings().database))
        return clock.now_ms()

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        """A changelist that does not load payloads."""
        return JobChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """A job id is looked up by primary key alone; anything else searches keys and errors."""
        term = search_term.strip()
        if JOB_ID_RE.fullmatch(term):
            return queryset.filter(pk=term), False
        return super().get_search_results(request, queryset, search_term)

    def get_urls(self) -> list[URLPattern]:
        """The model's URLs, plus the queue overview on the job admin."""
        urls = super().get_urls()
        if self.model is not Job:
            return urls
        overview = path(
            "overview/",
            self.admin_site.admin_view(self.overview_view),
            name="queue_core_job_overview",
        )
        tools = path(
            "maintenance/",
            self.admin_site.admin_view(self.maintenance_view),
            name="queue_core_job_maintenance",
        )
        control = path(
            "overview/queue/<str:queue>/<str:action>/",
            self.admin_site.admin_view(self.queue_control_view),
            name="queue_core_job_queue_control",
        )
        return [overview, tools, control, *urls]

    # ------------------------------------------------------------ list columns

    @admin.display(description="state")
    def state_badge(self, obj: Job) -> SafeString:
        """The state as a coloured label."""
        return format_html('<span class="relay-state relay-{}">{}</span>', obj.state, obj.state)

    @admin.display(description="priority")
    def priority_name(self, obj: Job) -> str:
        """low, normal, high or critical."""
        return Priority(obj.priority).name.lower()

    @admin.display(description="failures")
    def failures_of(self, obj: Job) -> str:
        """Failed attempts against the retry budget, e.g. ``2/3``."""
        return f"{obj.failures}/{obj.max_retries}"

    @admin.display(description="age")
    def age(self, obj: Job) -> str:
        """Time since submit."""
        return display.span_ms(self.now_ms() - obj.created_at_ms)

    @admin.display(description="last error")
    def short_error(self, obj: Job) -> SafeString:
        """The last error on one short line; more of it on hover (``display.HOVER_CHARS``)."""
        if not obj.last_error:
            return mark_safe(display.DASH)  # noqa: S308 - a constant
        return format_html(
            '<span title="{}">{}</span>',
            display.shorten(obj.last_error, display.HOVER_CHARS),
            display.shorten(obj.last_error, 70),
        )

    @admin.display(description="lease")
    def lease_holder(self, obj: Job) -> SafeString:
        """Who holds the lease, and when it expires."""
        if not obj.leased_by:
            return mark_safe(display.DASH)  # noqa: S308 - a constant
        return format_html(
            '{}<br><span class="relay-quiet">expires {}</span>',
            obj.leased_by,
            display.relative_ms(obj.lease_expires_at_ms, self.now_ms()),
        )

    # ---------------------------------------------------------- detail fields

    @admin.display(description="idempotency key")
    def idempotency(self, obj: Job) -> str:
        """The key and how long it stays bound (``unique: "active"``: also until the job
        finishes; a finished one has freed its key)."""
        active = obj.unique_scope == "active"
        if not obj.idempotency_key:
            return (
                f"{display.DASH} (unique while active: freed when the job finished)"
                if active
                else display.DASH
            )
        until = display.iso_ms(obj.idempotency_expires_at_ms)
        if active:
            return (
                f"{obj.idempotency_key} (unique while active: bound until the job finishes, "
                f"at most until {until})"
            )
        return f"{obj.idempotency_key} (bound until {until})"

    @admin.display(description="meta")
    def meta_pretty(self, obj: Job) -> SafeString:
        """The job's meta map (e.g. a ``traceparent``), indented, escaped, in a ``<pre>``."""
        if not obj.meta:
            return mark_safe(display.DASH)  # noqa: S308 - a constant
        return format_html('<pre class="relay-pre">{}</pre>', display.pretty_json(obj.meta))

    @admin.display(description="payload")
    def payload_pretty(self, obj: Job) -> SafeString:
        """The payload, indented, escaped, in a ``<pre>``."""
        return format_html('<pre class="relay-pre">{}</pre>', display.pretty_json(obj.payload))

    @admin.display(description="retry policy")
    def retry_policy(self, obj: Job) -> str:
        """Backoff kind, base and cap, jitter, and the retry budget."""
        jitter = "with jitter (50-100%)" if obj.jitter else "no jitter"
        return (
            f"{obj.backoff} backoff, base {display.span_ms(obj.backoff_base_ms)}, "
            f"cap {display.span_ms(obj.backoff_cap_ms)}, {jitter}; "
            f"up to {obj.max_retries} retries"
        )

    @admin.display(description="last error")
    def last_error_full(self, obj: Job) -> SafeString:
        """The whole last error, escaped."""
        if not obj.last_error:
            return mark_safe(display.DASH)  # noqa: S308 - a constant
        return format_html('<pre class="relay-pre">{}</pre>', obj.last_error)

    @admin.display(description="lease")
    def lease_times(self, obj: Job) -> str:
        """When the lease started and when it expires."""
        if obj.lease_expires_at_ms is None:
            return display.DASH
        return (
            f"since {display.iso_ms(obj.leased_at_ms)}, "
            f"expires {display.iso_ms(obj.lease_expires_at_ms)}"
        )

    @admin.display(description="lease token")
    def token_status(self, obj: Job) -> str:
        """Whether a live token exists and its last four characters (never the token)."""
        return display.token_status(
            obj.state, obj.lease_token, obj.lease_expires_at_ms, self.now_ms()
        )

    @admin.display(description="time limit")
    def time_limit(self, obj: Job) -> str:
        """The most one attempt may run (``time_limit_ms``), or a dash for none."""
        if obj.time_limit_ms is None:
            return display.DASH
        return display.span_ms(obj.time_limit_ms)

    @admin.display(description="cancel requested")
    def cancel(self, obj: Job) -> str:
        """When a cancel was asked for: a leased job stops at its worker's next renew."""
        if obj.cancel_requested_at_ms is None:
            return display.DASH
        when = self._at(obj.cancel_requested_at_ms)
        if obj.state == JobState.LEASED:
            return f"{when} (the worker stops it at its next renew)"
        return when

    def _at(self, ms: int | None) -> str:
        if ms is None:
            return display.DASH
        return f"{display.iso_ms(ms)} ({display.relative_ms(ms, self.now_ms())})"

    @admin.display(description="created")
    def created(self, obj: Job) -> str:
        """Submit time."""
        return self._at(obj.created_at_ms)

    @admin.display(description="due at")
    def available(self, obj: Job) -> str:
        """When a PENDING or RETRYING job becomes READY."""
        return self._at(obj.available_at_ms)

    @admin.display(description="ready since")
    def ready_since(self, obj: Job) -> str:
        """Since when a READY job waits (aging counts from here)."""
        return self._at(obj.ready_since_ms)

    @admin.display(description="updated")
    def updated(self, obj: Job) -> str:
        """Last change."""
        return self._at(obj.updated_at_ms)

    @admin.display(description="finished")
    def finished(self, obj: Job) -> str:
        """When the job succeeded or died."""
        return self._at(obj.finished_at_ms)

    @staticmethod
    def _stored_result(obj: Job) -> JobResult | None:
        """The result the job's worker sent (``relay_result``), if any; read once per page."""
        cached: JobResult | bool | None = getattr(obj, "_relay_result", False)
        if cached is False:
            cached = JobResult.objects.using(obj._state.db).filter(job_id=obj.pk).first()
            obj._relay_result = cached  # type: ignore[attr-defined]
        return cached if isinstance(cached, JobResult) else None

    @admin.display(description="status")
    def result_status(self, obj: Job) -> str:
        """The job's outcome so far, as a task result reads it (django.tasks' statuses for a
        Django task), with the attempts made."""
        status = display.result_status(obj.state, is_django_task(_payload_of(obj)))
        attempts = f"{obj.attempt} attempt{'s' if obj.attempt != 1 else ''}"
        return f"{status} ({attempts}, {obj.failures} failed)"

    @admin.display(description="return value")
    def return_value(self, obj: Job) -> SafeString:
        """The result the worker sent with its ack, indented and escaped (for a Django task,
        ``{"return_value": ...}`` or ``{"return_json": "..."}``)."""
        stored = self._stored_result(obj)
        if stored is None or stored.return_value is None:
            return mark_safe(display.DASH)  # noqa: S308 - a constant
        return format_html(
            '<pre class="relay-pre">{}</pre>', display.pretty_json(stored.return_value)
        )

    @admin.display(description="errors")
    def result_errors(self, obj: Job) -> SafeString:
        """Each failed attempt's exception class and traceback, as the worker sent them."""
        stored = self._stored_result(obj)
        entries = display.result_errors(stored.errors if stored else None)
        return mark_safe(  # noqa: S308 - the template autoescapes every value
            render_to_string("queue_admin/result_errors.html", {"entries": entries})
        )

    @admin.display(description="history")
    def history(self, obj: Job) -> SafeString:
        """The latest ``HISTORY_ROWS`` deliveries (with their errors) and the latest
        ``HISTORY_ROWS`` operator or recovery events, in order, and how many older attempts
        are not shown (older events: the audit log has them)."""
        rows: list[dict[str, Any]] = []
        db = obj._state.db
        attempts = list(
            JobAttempt.objects.using(db)
            .filter(job_id=obj.pk)
            .order_by("-attempt")[: HISTORY_ROWS + 1]
        )
        events = list(
            JobEvent.objects.using(db).filter(job_id=obj.pk).order_by("-id")[: HISTORY_ROWS + 1]
        )
        # Attempts are numbered 1, 2, ... per job: those before the oldest shown are hidden.
        hidden = attempts[HISTORY_ROWS - 1].attempt - 1 if len(attempts) > HISTORY_ROWS else 0
        older = {"attempts": hidden, "events": len(events) > HISTORY_ROWS}
        for a in attempts[:HISTORY_ROWS]:
            took = None if a.ended_at_ms is None else a.ended_at_ms - a.started_at_ms
            rows.append(
                {
                    "at_ms": a.started_at_ms,
                    "at": display.iso_ms(a.started_at_ms),
                    "what": f"attempt {a.attempt}",
                    "who": a.worker_id,
                    "token": display.token_tail(a.lease_token),
                    "result": a.outcome or "running",
                    "took": display.span_ms(took) if took is not None else "",
                    "error": a.error or "",
                }
            )
        for e in events[:HISTORY_ROWS]:
            rows.append(
                {
                    "at_ms": e.at_ms,
                    "at": display.iso_ms(e.at_ms),
                    "what": e.event,
                    "who": e.actor or "",
                    "token": "",
                    "result": f"{e.from_state or '∅'} → {e.to_state or '∅'}",
                    "took": "",
                    "error": e.detail or "",
                }
            )
        rows.sort(key=lambda r: r["at_ms"])
        audit = reverse("admin:queue_core_jobevent_changelist") + "?" + urlencode({"q": obj.pk})
        return mark_safe(  # noqa: S308 - the template autoescapes every value
            render_to_string(
                "queue_admin/history.html",
                {"rows": rows, "older": older, "limit": HISTORY_ROWS, "audit_url": audit},
            )
        )

    # ------------------------------------------------------------- permissions

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """May replay dead letters (``queue_core.replay_job``)."""
        return request.user.has_perm("queue_core.replay_job")

    def has_purge_permission(self, request: HttpRequest) -> bool:
        """May purge finished jobs (``queue_core.purge_job``)."""
        return request.user.has_perm("queue_core.purge_job")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """May cancel jobs (``queue_core.cancel_job``)."""
        return request.user.has_perm("queue_core.cancel_job")

    def has_pause_permission(self, request: HttpRequest) -> bool:
        """May pause and resume queues (``queue_core.pause_queue``)."""
        return request.user.has_perm("queue_core.pause_queue")

    def has_limit_permission(self, request: HttpRequest) -> bool:
        """May set queue limits (``queue_core.limit_queue``)."""
        return request.user.has_perm("queue_core.limit_queue")

    # ----------------------------------------------------------------- actions

    @admin.action(permissions=["replay"], description="Replay selected dead or cancelled jobs")
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """Redrive the selected DEAD (or CANCELLED) jobs to READY (confirmation page first)."""
        return self._confirm_or_run(request, queryset, Op.REPLAY)

    @admin.action(permissions=["cancel"], description="Cancel selected jobs")
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """Cancel the selected unfinished jobs (confirmation page first): waiting ones at once,
        running ones at their worker's next renew (``QueueService.cancel``; Oban's
        ``cancel_job``). Each cancel is an event in the audit log with the operator's name."""
        return self._confirm_or_run(request, queryset, Op.CANCEL)

    @admin.action(permissions=["purge"], description="Purge selected finished jobs")
    def purge_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """Delete the selected terminal jobs, keeping a purged event (confirmation first)."""
        return self._confirm_or_run(request, queryset, Op.PURGE)

    def eligible_states(self, op: Op) -> list[str]:
        """States ``op`` applies to from this list."""
        if op is Op.CANCEL:
            return [s.value for s in CANCELLABLE]
        if self.purge_dead_only:
            return [JobState.DEAD.value]
        if op is Op.REPLAY:
            return [JobState.DEAD.value, JobState.CANCELLED.value]
        return [JobState.DEAD.value, JobState.SUCCEEDED.value, JobState.CANCELLED.value]

    def _confirm_or_run(
        self, request: HttpRequest, queryset: QuerySet[Any], op: Op
    ) -> HttpResponse | None:
        select_across = request.POST.get("select_across") == "1"
        selected = list(dict.fromkeys(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)))
        if request.POST.get("post") == "yes":
            return self._run(request, queryset, op, select_across=select_across, ids=selected)
        return self._confirmation(request, queryset, op, select_across=select_across, ids=selected)

    @staticmethod
    def _matching(queryset: QuerySet[Any], *, select_across: bool, ids: list[str]) -> QuerySet[Any]:
        """The jobs the action would touch: all that match the filters, or the selection.

        A selection is looked up among all jobs, not just this list's, so the confirmation
        can say what became of a selected job that changed state since the list was shown.
        """
        if select_across:
            return queryset.order_by()
        return Job.objects.using(queryset.db).filter(pk__in=ids).order_by()

    def _confirmation(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        op: Op,
        *,
        select_across: bool,
        ids: list[str],
    ) -> TemplateResponse:
        matching = self._matching(queryset, select_across=select_across, ids=ids)
        eligible = self.eligible_states(op)
        by_state = {
            row["state"]: row["n"]
            for row in matching.values("state").annotate(n=Count("pk")).order_by()
        }
        will = sum(n for state, n in by_state.items() if state in eligible)
        others = sorted((state, n) for state, n in by_state.items() if state not in eligible)
        missing = 0 if select_across else max(0, len(ids) - sum(by_state.values()))
        sample = list(
            matching.filter(state__in=eligible)
            .order_by("id")
            .values_list("id", flat=True)[:SAMPLE_IDS]
        )
        from_detail = request.POST.get("_from_detail", "")
        opts = self.opts
        if from_detail and ids:
            back_url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[ids[0]])
        else:
            back_url = request.get_full_path()
        context = {
            **self.admin_site.each_context(request),
            "title": f"{op.value.capitalize()} {will:,} {self.noun}{'' if will == 1 else 's'}?",
            "opts": opts,
            "op": op.value,
            "op_label": op.value.capitalize(),
            "op_past": op.past,
            "action": request.POST.get("action", ""),
            "noun": self.noun,
            "will": will,
            "others": others,
            "missing": missing,
            "sample": sample,
            "more": max(0, will - len(sample)),
            "select_across": select_across,
            "selected": ids if not select_across else ids[:1],
            "filters": self._filter_description(request) if select_across else [],
            "confirmed_at_ms": self.now_ms(),
            "from_detail": from_detail,
            "back_url": back_url,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "queue_admin/confirm_action.html", context)

    @staticmethod
    def _filter_description(request: HttpRequest) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for key, values in sorted(request.GET.lists()):
            if key in NON_FILTER_PARAMS:
                continue
            label = "search" if key == "q" else key
            out.extend((label, value) for value in values if value)
        return out

    def _run(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        op: Op,
        *,
        select_across: bool,
        ids: list[str],
    ) -> HttpResponse | None:
        runner = BulkRunner(self.service(), actor=request.user.get_username())
        dead_only = op is Op.PURGE and self.purge_dead_only
        if select_across:
            try:
                confirmed_at = int(request.POST.get("confirmed_at_ms", ""))
            except ValueError:
                confirmed_at = self.now_ms()
            # Only jobs that were finished when the operator confirmed: a job that dies
            # after the confirmation page was shown is not swept up unseen (for a cancel:
            # only jobs submitted by then).
            states = self.eligible_states(op)
            # One state as "=" rather than "IN (...)", so SQLite can pick its partial index.
            in_state = {"state": states[0]} if len(states) == 1 else {"state__in": states}
            seen = (
                {"created_at_ms__lte": confirmed_at}
                if op is Op.CANCEL
                else {"finished_at_ms__lte": confirmed_at}
            )
            base = queryset.order_by().filter(**in_state, **seen)
            total = base.count()
            outcome = runner.run(op, _keyset(base), dead_only=dead_only, total=total)
        else:
            chunks = [ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK)]
            outcome = runner.run(op, chunks, dead_only=dead_only, total=len(ids))
        for level, text in describe(outcome, noun=self.noun):
            self.message_user(request, text, getattr(messages, level.upper()))
        if request.POST.get("_from_detail") and ids:
            job_id = ids[0]
            if job_id in outcome.done and op is Op.PURGE:
                return HttpResponseRedirect(request.path)
            return HttpResponseRedirect(
                reverse(f"admin:{Job._meta.app_label}_job_change", args=[job_id])
            )
        return None

    # ------------------------------------------------------------- page hooks

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        """Add replay/purge/cancel buttons for what this job and this operator allow."""
        buttons = []
        if obj is not None:
            if obj.state in self.eligible_states(Op.REPLAY) and self.has_replay_permission(request):
                buttons.append(("replay_selected", "Replay…"))
            if (
                obj.state in self.eligible_states(Op.CANCEL)
                and obj.cancel_requested_at_ms is None
                and self.has_cancel_permission(request)
            ):
                buttons.append(("cancel_selected", "Cancel…"))
            if obj.state in self.eligible_states(Op.PURGE) and self.has_purge_permission(request):
                buttons.append(("purge_selected", "Purge…"))
        opts = self.opts
        context["relay_buttons"] = buttons
        context["relay_action_url"] = reverse(
            f"admin:{opts.app_label}_{opts.model_name}_changelist"
        )
        context["relay_overview_url"] = reverse("admin:queue_core_job_overview")
        return super().render_change_form(request, context, add, change, form_url, obj)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, with the overview link and (dead letters) the match-all buttons."""
        extra = dict(extra_context or {})
        extra.setdefault("title", self.list_title)
        extra["relay_overview_url"] = reverse("admin:queue_core_job_overview")
        extra["relay_maintenance_url"] = reverse("admin:queue_core_job_maintenance")
        extra["relay_bulk"] = self.bulk_buttons(request)
        return super().changelist_view(request, extra)

    def bulk_buttons(self, request: HttpRequest) -> list[tuple[str, str]]:
        """``(action, label)`` for acting on everything that matches (none on this list)."""
        return []

    # ---------------------------------------------------------------- overview

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        """Per queue: counts by state, oldest ready age, leases now, recent failures."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            data = build_overview(self.service(), after=request.GET.get("after") or None)
        except InvalidArgument as exc:
            raise BadRequest(str(exc)) from exc
        context = {
            **self.admin_site.each_context(request),
            "title": "Queue overview",
            "opts": self.opts,
            "overview": data,
            "next_query": urlencode({"after": data.next_after or ""}),
            "media": self.media,
            "can_pause": self.has_pause_permission(request),
            "can_limit": self.has_limit_permission(request),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "queue_admin/overview.html", context)

    def maintenance_view(self, request: HttpRequest) -> HttpResponse:
        """Prune finished jobs by age, back up the database (``queue_admin.maintenance``)."""
        return maintenance.view(self, request)

    def queue_control_view(self, request: HttpRequest, queue: str, action: str) -> HttpResponse:
        """Pause, resume or set the limits of one queue: a confirmation page (GET, or a POST
        that failed validation), then the change through ``QueueService`` with the operator
        as the actor (POST with ``post=yes``), then back to the overview with a message.

        Raises:
            PermissionDenied: without ``queue_core.pause_queue`` (pause, resume) or
                ``queue_core.limit_queue`` (limits). Http404: an unknown action.
        """
        allowed = {
            "pause": self.has_pause_permission,
            "resume": self.has_pause_permission,
            "limits": self.has_limit_permission,
        }
        if action not in allowed:
            raise Http404(f"no queue action {action!r}")
        if not allowed[action](request):
            raise PermissionDenied
        service = self.service()
        back = reverse("admin:queue_core_job_overview")
        try:
            current = service.queue_controls(queue)["queues"][queue]
        except RelayError as exc:
            messages.error(request, f"{exc.code}: {exc.message}")
            return HttpResponseRedirect(back)
        form = QueueLimitsForm(request.POST or None, initial=_limits_initial(current))
        if request.method == "POST" and request.POST.get("post") == "yes":
            actor = request.user.get_username()
            try:
                if action == "pause":
                    service.pause(queue, actor=actor)
                    messages.success(request, f"Queue {queue} paused: nothing new is leased.")
                elif action == "resume":
                    service.resume(queue, actor=actor)
                    messages.success(request, f"Queue {queue} resumed.")
                elif form.is_valid():
                    out = service.set_queue_limits(queue, actor=actor, **form.limits())
                    messages.success(request, f"Queue {queue}: {_describe_limits(out)}.")
                else:
                    return self._control_page(request, queue, action, current, form)
            except RelayError as exc:
                messages.error(request, f"{exc.code}: {exc.message}")
            return HttpResponseRedirect(back)
        return self._control_page(request, queue, action, current, form)

    def _control_page(
        self,
        request: HttpRequest,
        queue: str,
        action: str,
        current: dict[str, Any],
        form: QueueLimitsForm,
    ) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": f"{action.capitalize()} queue {queue}",
            "opts": self.opts,
            "media": self.media,
            "queue": queue,
            "action": action,
            "current": current,
            "current_limits": _describe_limits(current),
            "form": form,
            "back_url": reverse("admin:queue_core_job_overview"),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "queue_admin/queue_control.html", context)


def _payload_of(obj: Job) -> Any:
    """A job's payload, decoded (None when the stored text is not JSON)."""
    try:
        return orjson.loads(obj.payload)
    except orjson.JSONDecodeError:
        return None


class QueueLimitsForm(forms.Form):
    """The limits page's fields: empty means no cap / no rate."""

    max_leased = forms.IntegerField(
        required=False, min_value=1, max_value=1_000_000, label="Most jobs leased at once"
    )
    rate_per_s = forms.FloatField(
        required=False, min_value=0, max_value=1_000_000, label="Jobs started per second"
    )
    burst = forms.IntegerField(
        required=False, min_value=1, max_value=1_000_000, label="Burst (jobs at once)"
    )

    def limits(self) -> dict[str, Any]:
        """The ``set_queue_limits`` arguments: an empty field removes that limit."""
        data = self.cleaned_data
        return {
            "max_leased": data.get("max_leased") or 0,
            "rate_per_s": data.get("rate_per_s") or 0,
            "burst": data.get("burst") or 1,
        }


def _limits_initial(controls: dict[str, Any]) -> dict[str, Any]:
    return {
        "max_leased": controls.get("max_leased"),
        "rate_per_s": controls.get("rate_per_s"),
        "burst": controls.get("burst"),
    }


def _describe_limits(controls: dict[str, Any]) -> str:
    cap = controls.get("max_leased")
    rate = controls.get("rate_per_s")
    parts = [f"at most {cap} leased" if cap else "no cap"]
    parts.append(f"{rate:g} started/s (burst {controls.get('burst')})" if rate else "no rate")
    return ", ".join(parts)


def _keyset(queryset: QuerySet[Any]) -> Iterator[list[str]]:
    """Page through ``queryset`` ids in id order, ``CHUNK`` at a time (never all in memory).

    Each page is read after the previous chunk committed, so ids the runner changed no
    longer match and the seek starts after the last id seen.
    """
    last = ""
    while True:
        ids = list(queryset.filter(id__gt=last).order_by("id").values_list("id", flat=True)[:CHUNK])
        if not ids:
            return
        yield ids
        last = ids[-1]


@admin.register(DeadLetter)
class DeadLetterAdmin(JobAdmin):
    """DEAD jobs only: the list operators fix things from."""

    purge_dead_only = True
    noun = "dead letter"
    list_title = "Dead letters"
    list_display = (
        "id",
        "queue",
        "priority_name",
        "failures_of",
        "short_reason",
        "short_error",
        "dead_since",
        "age",
    )
    list_filter = (QueueFilter, "priority")
    actions = ("replay_selected", "purge_selected")  # nothing to cancel: dead jobs are finished

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """DEAD jobs only (the relay_job_dead partial index)."""
        return super().get_queryset(request).filter(state=JobState.DEAD)

    @admin.display(description="why")
    def short_reason(self, obj: Job) -> str:
        """Why it died: non-retryable, attempts exhausted or lease expired.

        The dead reason repeats the error after a colon; the error has its own column.
        """
        return display.shorten((obj.dead_reason or "").split(":", 1)[0], 30)

    @admin.display(description="dead for")
    def dead_since(self, obj: Job) -> str:
        """Time since it died."""
        if obj.finished_at_ms is None:
            return display.DASH
        return display.span_ms(self.now_ms() - obj.finished_at_ms)

    def bulk_buttons(self, request: HttpRequest) -> list[tuple[str, str]]:
        """Replay or purge everything that matches the current filters."""
        out: list[tuple[str, str]] = []
        if self.has_replay_permission(request):
            out.append(("replay_selected", "Replay all matching…"))
        if self.has_purge_permission(request):
            out.append(("purge_selected", "Purge all matching…"))
        return out


class EventFilter(admin.SimpleListFilter):
    """Filter the audit log by event (fixed choices: no query)."""

    title = "event"
    parameter_name = "event"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        """The events operators and recovery record."""
        return [
            (e, e)
            for e in (
                "replayed",
                "purged",
                "recovered",
                "cancelled",
                "cancel_requested",
                "paused",
                "resumed",
                "limits_set",
                "pruned",
                "backed_up",
            )
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Events of the chosen kind."""
        value = self.value()
        return queryset.filter(event=value) if value else queryset


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyAdmin):
    """The audit log: who replayed, purged or cancelled what, and when (outlives purged jobs)."""

    list_display = ("at", "job", "event", "transition", "actor", "detail")
    list_filter = (EventFilter,)
    search_fields = ("=job_id", "=actor")
    search_help_text = "A job id, or an operator's username."
    ordering = ("-id",)
    sortable_by = ()
    list_display_links = None

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The audit log, titled as such."""
        return super().changelist_view(request, {"title": "Audit log", **(extra_context or {})})

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """A job id (or ``queue:<name>``) is an index seek on (job_id, id); anything else is
        an operator name."""
        term = search_term.strip()
        if not term:
            return queryset, False
        if JOB_ID_RE.fullmatch(term) or term.startswith("queue:"):
            return queryset.filter(job_id=term), False
        return queryset.filter(actor=term), False

    @admin.display(description="at")
    def at(self, obj: JobEvent) -> str:
        """When, UTC."""
        return display.iso_ms(obj.at_ms)

    @admin.display(description="job")
    def job(self, obj: JobEvent) -> SafeString:
        """The job, linked unless it was purged; a dash for an action on no one job."""
        if not obj.job_id:
            return format_html("{}", display.DASH)
        if obj.event == "purged" or not obj.job_id.startswith("job_"):
            return format_html("{}", obj.job_id)  # gone, or a queue's control (queue:<name>)
        url = reverse("admin:queue_core_job_change", args=[obj.job_id])
        return format_html('<a href="{}">{}</a>', url, obj.job_id)

    @admin.display(description="transition")
    def transition(self, obj: JobEvent) -> str:
        """from -> to."""
        return f"{obj.from_state or '∅'} → {obj.to_state or '∅'}"
