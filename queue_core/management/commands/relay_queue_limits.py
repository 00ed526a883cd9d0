"""``relay queue-limits QUEUE [--max-leased N] [--rate R] [--burst B]``: show or set a queue's
cap on leased jobs (all workers) and its start rate (a token bucket)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from queue_core.client import RelayClient
from queue_core.management.commands.relay_pause import describe
from queue_core.management.relay_command import RelayClientCommand


class Command(RelayClientCommand):
    """Set (or, with no option, show) a queue's limits (the ``set_queue_limits`` op)."""

    help = (
        "Show or set a queue's limits: --max-leased N caps the jobs leased at once across "
        "every worker (0 removes the cap); --rate R lets at most R jobs start per second, "
        "--burst B of them at once after a quiet spell (--rate 0 removes the rate). Options "
        "left out keep their value; with none, the limits are shown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        """Define QUEUE, --max-leased, --rate, --burst."""
        parser.add_argument("queue", metavar="QUEUE")
        parser.add_argument(
            "--max-leased", type=int, metavar="N", help="Most jobs leased at once; 0: no cap."
        )
        parser.add_argument(
            "--rate", type=float, metavar="R", help="Jobs started per second; 0: no rate."
        )
        parser.add_argument(
            "--burst", type=int, metavar="B", help="Jobs that may start at once (default 1)."
        )
        super().add_arguments(parser)

    def run(self, client: RelayClient, **options: Any) -> None:
        """Set the limits given (or read them) and print the queue's controls."""
        limits = {
            "max_leased": options["max_leased"],
            "rate_per_s": options["rate"],
            "burst": options["burst"],
        }
        if any(value is not None for value in limits.values()):
            controls = dict(client.set_queue_limits(options["queue"], **limits))
        else:
            controls = dict(client.queue_controls(options["queue"])["queues"][options["queue"]])
        if options["json"]:
            self.print_json(controls)
            return
        self.stdout.write(describe(controls))
