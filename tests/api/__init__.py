"""The Python API (registry/api/): the `Registry` contract and its wire form, typed results,
the remote client, release fetching on a consumer's machine."""
