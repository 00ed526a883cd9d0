"""``manage.py order_status TASK_ID``: print a receipt task's status (and return value)."""

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.tasks import TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist

from shop.tasks import send_receipt


class Command(BaseCommand):
    help = "Print the status of a send_receipt task."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("task_id")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = send_receipt.get_result(options["task_id"])
        except TaskResultDoesNotExist:
            self.stdout.write("DOES_NOT_EXIST")
            return
        line = f"{result.status} attempts={result.attempts}"
        if result.status == TaskResultStatus.SUCCESSFUL:
            line += f" return_value={result.return_value}"
        self.stdout.write(line)
