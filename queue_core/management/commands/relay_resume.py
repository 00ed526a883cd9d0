"""``relay resume QUEUE``: lease from a paused queue again (its waiting long-polls wake)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from queue_core.client import RelayClient
from queue_core.management.commands.relay_pause import describe
from queue_core.management.relay_command import RelayClientCommand


class Command(RelayClientCommand):
    """Resume one or more queues through the server (the ``resume`` op)."""

    help = "Resume paused queues: the server leases from them again."

    def add_arguments(self, parser: CommandParser) -> None:
        """Define QUEUE..."""
        parser.add_argument("queues", nargs="+", metavar="QUEUE")
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Resume each queue in turn and print its controls."""
        results = [dict(client.resume(queue)) for queue in dict.fromkeys(options["queues"])]
        if options["json"]:
            self.print_json({"queues": results})
            return
        for controls in results:
            self.stdout.write(describe(controls))
