"""Remote mode (DESIGN §9): `REG_URL` set, every call goes to `reg server` with a token.

client.py     HTTP calls; a server error body becomes the same RegistryError (and exit code)
reader.py     a read-only store over the server's file endpoint (pull, validation)
registry.py   RemoteRegistry: the `Registry` API, each method one or a few requests
"""
