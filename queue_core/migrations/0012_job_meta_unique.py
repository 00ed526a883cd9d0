"""Job metadata and unique-while-active idempotency keys (issue 16, items 6 and 7).

``meta`` holds a job's optional map of strings (canonical JSON text, at most
``RELAY_MAX_META_BYTES``); ``unique_scope`` is ``"active"`` for a job submitted with
``unique: "active"`` (its idempotency key is freed when it reaches a terminal state) and NULL
otherwise. Both columns are nullable without a default, so on SQLite each is one ``ALTER TABLE
ADD COLUMN`` (no table rebuild: the triggers of 0007 stay), and on PostgreSQL a catalogue-only
change.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("queue_core", "0011_cancel_time_limit"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="unique_scope",
            field=models.CharField(blank=True, max_length=8, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="meta",
            field=models.TextField(
                blank=True, help_text="Canonical JSON object of strings.", null=True
            ),
        ),
    ]
