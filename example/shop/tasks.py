"""The shop's background work, written with Django's own ``@task`` API."""

from typing import Any

from django.tasks import TaskContext, task

from shop.models import Order


@task(queue_name="emails", priority=50, takes_context=True)
def send_receipt(context: TaskContext, order_id: int) -> dict[str, Any]:
    """Email the receipt of an order (printed here). Idempotent: a second run sends nothing.

    Relay delivers at least once, so the task checks and records what it did.
    """
    order = Order.objects.get(pk=order_id)
    if not order.receipt_sent:
        print(f"emailing receipt of {order} (attempt {context.attempt})", flush=True)
        Order.objects.filter(pk=order_id).update(receipt_sent=True)
    return {"order_id": order_id, "email": order.email}
