"""The catalog (registry/catalog/): migrations and database guards, least-privilege roles,
claims, leases and holds."""
