"""Django app config for relay_tasks."""

from django.apps import AppConfig


class RelayTasksConfig(AppConfig):
    """Stores the return values and errors of Django tasks run on Relay."""

    name = "relay_tasks"
    verbose_name = "Relay task results"
    default_auto_field = "django.db.models.BigAutoField"
