"""The two lifecycles (registry/lifecycle/): checkpoints pushed, claimed, read and verified;
validation; promotion to releases; the release workflow; signing after the fact."""
