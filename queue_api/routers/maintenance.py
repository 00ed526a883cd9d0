"""Operator maintenance over HTTP: prune finished jobs by age, one bounded batch per request.

Backups have no HTTP route: ``relay backup PATH`` and the console write a file on the
server's own disk, which is not something a remote API key should choose.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router

from queue_api import calls
from queue_api.routers._common import ERRORS
from queue_api.schemas import PruneIn, PruneOut
from queue_api.security import ApiKey

router = Router(tags=["maintenance"])


@router.post(
    "/prune",
    response={200: PruneOut, **ERRORS},
    auth=ApiKey("prune"),
    summary="Prune finished jobs by age (one batch)",
)
def prune(request: HttpRequest, body: PruneIn) -> dict[str, Any]:
    """Delete up to ``limit`` SUCCEEDED, DEAD and/or CANCELLED jobs that finished more than
    ``older_than_ms`` ago, with their history, in one short transaction; repeat while
    ``more``. The server's retention does the same by itself (``RELAY_RETENTION_*``)."""
    result: dict[str, Any] = calls.run(request, "prune", body.model_dump())
    return result
