"""The shared tier: the store's Zarr layout on S3-compatible object storage (``[gdskv.remote]``).

- ``client``: the object-store client (obstore), requests with deadlines, outcomes not exceptions;
- ``listing``: listings that go on past keys obstore cannot name (its own signed ListObjectsV2);
- ``objects``: chunk object keys, verification of fetched objects, atomic local publication;
- ``tier``: what a ``KvService`` holds: read-through at lookup, health, uploads after a save;
- ``upload``: create-only uploads (write-behind queue, write-through, leftovers at start);
- ``copy``: whole-namespace push / pull and bucket listings for the CLI;
- ``throttle``: warnings a wrong setting would repeat for every request, said once per spell.

Imports run down: ``gdskv.service`` -> ``gdskv.remote`` -> store / format / checksum.
"""
from gdskv.remote.client import ObjectClient, Outcome, RemoteSetupError, RemoteUnavailable
from gdskv.remote.tier import RemoteTier

__all__ = ["ObjectClient", "Outcome", "RemoteSetupError", "RemoteTier", "RemoteUnavailable"]
