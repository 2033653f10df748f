"""Webhooks: the catalog's events POSTed to the subscribers the policy names.

events    which outbox events a subscriber receives, and the body's stable schema
net       one POST where the server may send it (https, no redirects, checked addresses)
fanout    the outbox's events copied into one delivery row per subscriber
deliver   attempts, retries and backoff; the server's loop and the embedded process
admin     what `reg webhook ls|test|deliveries` show

The secret file's rules and the `X-Reg-Signature` header are `trust/webhook_signatures.py`
(`reg policy apply` checks a webhook's secret file too). The embedded deliverer is
`python -m registry.integrations.webhooks`, started after a command by
`core.detached.spawn_deliverer`.
"""
