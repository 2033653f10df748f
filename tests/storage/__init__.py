"""Object stores (registry/storage/): the BaseStore conformance suite run on every backend,
and the S3 store against real S3 servers."""
