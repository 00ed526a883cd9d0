"""Queue controls: ``relay_queue``, one row per queue an operator paused, capped or rate-limited.

Read by every claim that names the queue (one primary-key seek per queue; PostgreSQL locks the
rows of the queues it claims from, so two servers cannot both pass a cap). No row: the queue
runs unlimited, as before this migration.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('queue_core', '0009_retention_indexes'),
    ]

    operations = [
        migrations.CreateModel(
            name='QueueSettings',
            fields=[
                ('name', models.CharField(max_length=128, primary_key=True, serialize=False)),
                ('paused', models.BooleanField(default=False)),
                ('max_leased', models.IntegerField(blank=True, help_text='Most jobs leased at once, all workers; null: no cap.', null=True)),
                ('rate_per_s', models.FloatField(blank=True, help_text='Jobs started per second (token bucket); null: no rate.', null=True)),
                ('burst', models.IntegerField(default=1, help_text='Tokens the bucket holds at most.')),
                ('tokens', models.FloatField(default=0.0)),
                ('tokens_at_ms', models.BigIntegerField(default=0)),
                ('updated_at_ms', models.BigIntegerField()),
                ('updated_by', models.CharField(blank=True, max_length=150, null=True)),
            ],
            options={
                'verbose_name': 'queue settings',
                'verbose_name_plural': 'queue settings',
                'db_table': 'relay_queue',
                'permissions': [('pause_queue', 'Can pause and resume queues'), ('limit_queue', 'Can set queue limits')],
                'constraints': [models.CheckConstraint(condition=models.Q(('max_leased__isnull', True), ('max_leased__gte', 1), _connector='OR'), name='relay_queue_max_leased_positive'), models.CheckConstraint(condition=models.Q(('rate_per_s__isnull', True), ('rate_per_s__gt', 0), _connector='OR'), name='relay_queue_rate_positive'), models.CheckConstraint(condition=models.Q(('burst__gte', 1)), name='relay_queue_burst_positive')],
            },
        ),
    ]
