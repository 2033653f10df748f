"""Reading what trainers write without trusting it, and the registry's own documents
(registry/formats/): DCP, torch archives, DeepSpeed, the transformers Trainer, sidecars, release
extras, each framework's own save; parsing bounds and fuzzing."""
