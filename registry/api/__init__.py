"""The Python API: the `Registry` contract (contract.py), its HTTP description (wire.py), its typed
results (results/), the two implementations (local.py embedded, remote/ through `reg server`) and
release fetching over either (consumers/). `registry` re-exports what users import."""
