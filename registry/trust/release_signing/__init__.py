"""Release signing: keys, the model-signing bundle, provenance."""
