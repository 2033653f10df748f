"""`reg advise` (registry/economics/): the waste model, the two-level model, what a job
really paid, and the heartbeats it is measured from."""
