"""Django app config for queue_api (the HTTP API, its API-key admin and /metrics)."""

from django.apps import AppConfig


class QueueApiConfig(AppConfig):
    """Relay's HTTP API: django-ninja under gunicorn, on the same service layer as TCP."""

    name = "queue_api"
    verbose_name = "Relay HTTP API"

    def ready(self) -> None:
        """Register Relay's database-backed gauges on the default Prometheus registry."""
        from queue_core import metrics

        metrics.install_collector()
