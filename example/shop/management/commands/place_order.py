"""``manage.py place_order EMAIL CENTS [--rollback]``: create an order and enqueue its receipt
in one transaction; with ``--rollback`` the transaction is rolled back and no task ever runs."""

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from shop.models import Order
from shop.tasks import send_receipt


class Command(BaseCommand):
    help = "Place an order and enqueue its receipt email in the same transaction."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("email")
        parser.add_argument("cents", type=int)
        parser.add_argument("--rollback", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():
            order = Order.objects.create(email=options["email"], total_cents=options["cents"])
            result = send_receipt.enqueue(order_id=order.pk)
            order.receipt_task_id = result.id
            order.save(update_fields=["receipt_task_id"])
            if options["rollback"]:
                transaction.set_rollback(True)
        self.stdout.write(result.id)
