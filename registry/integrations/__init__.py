"""What reg tells other systems: the outbox of catalog events (outbox.py), drained into MLflow
(mirror/) and delivered as signed webhooks (webhooks/), always after the command that caused
them."""
