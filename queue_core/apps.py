"""Django app config for queue_core."""

from django.apps import AppConfig


class QueueCoreConfig(AppConfig):
    """Relay's core app: models, service layer, protocol, server, worker and commands."""

    name = "queue_core"
    verbose_name = "Relay queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register system checks, watch new SQLite connections (the file each one opened,
        its write-ahead log bound: ``queue_core.storage.sqlite.driver``), and turn SQLite's
        memory statistics off while no connection is open yet
        (``queue_core.storage.sqlite.library.memory_statistics_off``).

        The checks are Relay's settings (``queue_core.checks``) and Django's tasks checks,
        which run each ``TASKS`` backend's ``check()`` (``RelayBackend``: ``relay.E101``...).
        Django registers the latter only when ``django.tasks`` is imported, which a project
        may not do before ``manage.py check``: importing it here makes sure they run.
        """
        import django.tasks  # noqa: F401  (registers django.tasks.checks.check_tasks)

        from queue_core import checks  # noqa: F401
        from queue_core.storage.sqlite.driver import watch_connections
        from queue_core.storage.sqlite.library import memory_statistics_off

        memory_statistics_off()
        watch_connections()
