"""The console's maintenance page: prune finished jobs by age, and back up the database.

Both go through ``QueueService`` with the operator as the actor, so the audit log records who
did what (an event with no job id: ``pruned`` with the counts, ``backed_up`` with the path).

* **Prune** needs ``queue_core.purge_job`` (a prune is a purge by age) and a confirmation page
  that states how many jobs will go. One run deletes at most ``MAX_BATCHES`` batches of
  ``PRUNE_BATCH`` jobs (about 20,000 jobs, a few seconds), each its own short transaction, so
  one request never outlives the server's timeout; the page says when more remain.
* **Back up now** needs a superuser (the copy holds every payload) and ``RELAY_BACKUP_DIR``:
  it writes ``relay-YYYYmmddTHHMMSSZ.db`` there with SQLite's online backup API and checks the
  copy (``relay backup``'s path, docs/failure-model.md). There is nothing to confirm: it
  changes no job.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse

from queue_core import errors
from queue_core.conf import parse_duration_ms, relay_settings
from queue_core.service import PRUNABLE_STATES, PRUNE_BATCH

if TYPE_CHECKING:
    from queue_admin.admin import JobAdmin

log = logging.getLogger("relay.admin")

MAX_BATCHES = 200
STATE_CHOICES = [("all", "succeeded, dead and cancelled"), *((s, s) for s in PRUNABLE_STATES)]


def _ages(request: HttpRequest) -> tuple[dict[str, int], str, str]:
    """``({state: ms}, older_than text, state)`` from the form.

    Raises:
        InvalidArgument: not a duration above 0, or an unknown state.
    """
    text = request.POST.get("older_than", "").strip()
    state = request.POST.get("state", "all")
    try:
        age = parse_duration_ms(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"older than: {exc}", field="older_than") from None
    if age <= 0:
        raise errors.InvalidArgument("older than: must be more than 0", field="older_than")
    if state == "all":
        return dict.fromkeys(PRUNABLE_STATES, age), text, state
    if state not in PRUNABLE_STATES:
        raise errors.InvalidArgument(f"state: unknown state {state!r}", field="state")
    return {state: age}, text, state


def view(admin: JobAdmin, request: HttpRequest) -> HttpResponse:
    """GET: the page. POST ``action=prune``: the confirmation page, then (``post=yes``) the
    prune. POST ``action=backup``: the copy."""
    if not admin.has_view_permission(request):
        raise PermissionDenied
    context: dict[str, Any] = {
        **admin.admin_site.each_context(request),
        "title": "Maintenance",
        "opts": admin.opts,
        "media": admin.media,
        "states": STATE_CHOICES,
        "can_prune": admin.has_purge_permission(request),
        "can_backup": request.user.is_superuser,
        "backup_dir": relay_settings().backup_dir,
        "max_jobs": MAX_BATCHES * PRUNE_BATCH,
        "older_than": "30d",
        "state": "all",
    }
    request.current_app = admin.admin_site.name
    action = request.POST.get("action") if request.method == "POST" else None
    if action == "prune":
        if not context["can_prune"]:
            raise PermissionDenied
        try:
            ages, context["older_than"], context["state"] = _ages(request)
        except errors.InvalidArgument as exc:
            messages.error(request, str(exc))
            return TemplateResponse(request, "queue_admin/maintenance.html", context)
        if request.POST.get("post") == "yes":
            return _prune(admin, request, ages)
        counts = admin.service().count_prunable(ages)
        context.update(confirm=True, counts=counts, will=sum(counts.values()))
    elif action == "backup":
        if not context["can_backup"]:
            raise PermissionDenied
        return _backup(admin, request)
    return TemplateResponse(request, "queue_admin/maintenance.html", context)


def _prune(admin: JobAdmin, request: HttpRequest, ages: dict[str, int]) -> HttpResponse:
    actor = request.user.get_username()
    try:
        deleted = admin.service().prune(
            ages, batch=PRUNE_BATCH, max_batches=MAX_BATCHES, actor=actor
        )
    except errors.RelayError as exc:
        messages.error(request, f"{exc.code}: {exc}")
        return HttpResponseRedirect(request.path)
    total = sum(deleted.values())
    words = ", ".join(f"{n:,} {state}" for state, n in deleted.items())
    log.info("event=console_prune actor=%s %s", actor, words, extra={"event": "console_prune"})
    if total >= MAX_BATCHES * PRUNE_BATCH:
        messages.warning(request, f"Pruned {words}; more remain: prune again to go on.")
    else:
        messages.success(request, f"Pruned {words} job{'s' if total != 1 else ''}.")
    return HttpResponseRedirect(request.path)


def _backup(admin: JobAdmin, request: HttpRequest) -> HttpResponse:
    folder = relay_settings().backup_dir
    if not folder:
        messages.error(request, "Set RELAY_BACKUP_DIR to back up from the console.")
        return HttpResponseRedirect(request.path)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = Path(folder) / f"relay-{stamp}.db"
    actor = request.user.get_username()
    try:
        copy = admin.service().backup(str(path), actor=actor)
    except (errors.RelayError, OSError, ValueError, NotImplementedError) as exc:
        messages.error(request, f"Backup failed: {exc}")
        return HttpResponseRedirect(request.path)
    messages.success(request, f"Backed up to {copy['path']} ({copy['bytes']:,} bytes, checked).")
    return HttpResponseRedirect(request.path)
