"""What every router declares: the error responses (problem details) of its operations."""

from __future__ import annotations

from typing import Any

from queue_api.schemas import ProblemOut

# Error statuses the operations may answer with, each as application/problem+json.
ERRORS: dict[Any, Any] = {
    frozenset({400, 401, 403, 404, 409, 413, 415, 422}): ProblemOut,
    frozenset({500, 503}): ProblemOut,
}
