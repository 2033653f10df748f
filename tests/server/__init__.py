"""`reg server` (registry/server/): HTTP, tokens and OIDC, abuse and load, claims and presigned
pushes through the server."""
