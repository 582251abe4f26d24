"""The ZeroMQ block-fetch wire format, shared by the server and the client.

Request (DEALER -> ROUTER):  [PROTOCOL, namespace digest (16 bytes), names (16 bytes each, concatenated)]
Reply:                       [PROTOCOL, status, server's namespace digest, one frame per name]
status: b"ok", b"namespace" (the digests differ: no blocks follow) or b"bad-request".
Each block frame is the tiers' frame (kv/tiers/frame.py: magic, length, xxh3-64) around the block in
its stored format (kv/data/tiers/codec.py), or empty when the server does not hold that block.
"""
from __future__ import annotations

PROTOCOL = b"EBKV-FETCH/1"
OK, NAMESPACE, BAD_REQUEST = b"ok", b"namespace", b"bad-request"
