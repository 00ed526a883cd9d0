"""``relay pause QUEUE``: stop leasing from a queue (submits still accepted, leased jobs finish)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from queue_core.client import RelayClient
from queue_core.management.relay_command import RelayClientCommand, fmt_ms


def describe(controls: dict[str, Any]) -> str:
    """One line for a queue's controls: ``QUEUE: paused|running, cap N, rate R/s (burst B)``."""
    parts = [f"{controls['queue']}: {'paused' if controls['paused'] else 'running'}"]
    parts.append(f"cap {controls['max_leased']}" if controls["max_leased"] else "no cap")
    rate = controls["rate_per_s"]
    parts.append(f"rate {rate:g}/s (burst {controls['burst']})" if rate else "no rate")
    line = ", ".join(parts)
    if controls.get("updated_at_ms"):
        line += f"; set {fmt_ms(controls['updated_at_ms'])}"
    return line


class Command(RelayClientCommand):
    """Pause one or more queues through the server (the ``pause`` op)."""

    help = (
        "Pause queues: the server accepts submits and lets leased jobs finish, but leases "
        "nothing new from them until 'relay resume'. Survives restarts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define QUEUE..."""
        parser.add_argument("queues", nargs="+", metavar="QUEUE")
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Pause each queue in turn and print its controls."""
        results = [dict(client.pause(queue)) for queue in dict.fromkeys(options["queues"])]
        if options["json"]:
            self.print_json({"queues": results})
            return
        for controls in results:
            self.stdout.write(describe(controls))
