"""Results of Django tasks run on Relay (``queue_core.tasks_backend.RelayBackend``).

Relay's job table has no column for a return value or a traceback, so the ``relay_worker
--tasks`` executor writes them here, keyed by job id; ``RelayBackend.get_result`` reads them
back next to the job's state and attempt history.
"""
