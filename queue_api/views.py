"""Plain Django views beside the API: /metrics, and problem details for unknown API paths."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import CONTENT_TYPE_LATEST

from queue_api.problems import problem_response
from queue_core import errors, metrics


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of this gunicorn worker process.

    django-prometheus's request metrics and Relay's counters and histograms count what this
    process did; Relay's gauges are read from the database now (see docs/metrics.md).
    """
    metrics.install_collector()
    return HttpResponse(metrics.exposition(), content_type=CONTENT_TYPE_LATEST)


@csrf_exempt  # the API authenticates by key, never by cookie: a POST gets the 404, not a 403
def api_not_found(request: HttpRequest, rest: str = "") -> HttpResponse:
    """404 as a problem for a path under /api/ that no endpoint serves, whatever the method."""
    return problem_response(
        request, errors.JobNotFound(f"no endpoint {request.path}; see /api/v1/docs")
    )
