"""`reg server`: the one trusted process of a shared registry (DESIGN §9).

It alone holds the catalog and store credentials. Every request carries a bearer token; the
server verifies it, builds a `Context` around the principal the token names, and runs the same
lifecycle code as the embedded mode. Clients (`REG_URL`, `registry.api.remote`) never touch the
catalog or the store.

    app.py          the FastAPI application: state, middleware, errors, health, metrics
    auth.py         token -> Principal -> Context, per request
    requests.py     the token first, then a bounded JSON body (idle limit, parsed off the loop)
    contract_routes.py  the endpoints derived from the contract's `@http` methods (api/wire.py)
    routes.py       the hand-written endpoints: validation, promotion, policy, heartbeat, whoami
    claims.py       shared claims: renew, a file streamed in, commit
    data.py         the data path: a push streamed in, files of readable artifacts read out
    upload.py       a push's framed byte stream -> a private directory the server scans itself
    metrics.py      Prometheus counters and histograms
    background.py   the MLflow drain and the GC schedule (one leader among replicas)
    bootstrap.py    `reg server init --admin NAME`
"""
