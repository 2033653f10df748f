"""Release signing (issue 37): keys, the model-signing bundle, provenance."""
