"""The shop's one model: an order, created together with the task that emails its receipt."""

from django.db import models


class Order(models.Model):
    """A placed order; ``receipt_task_id`` is the id of its ``send_receipt`` task result."""

    email = models.EmailField()
    total_cents = models.PositiveIntegerField()
    receipt_task_id = models.CharField(max_length=40, blank=True)
    receipt_sent = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"order {self.pk} for {self.email}"
