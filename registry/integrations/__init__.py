"""What reg tells other systems, from the outbox of catalog events (`journal/outbox.py`): drained
into MLflow (mirror/) and delivered as signed webhooks (webhooks/), always after the command that
caused them. Both read the registry; nothing below this layer imports them."""
