"""What reg tells other systems (registry/integrations/): the MLflow mirror and `reg ui`,
signed webhooks."""
