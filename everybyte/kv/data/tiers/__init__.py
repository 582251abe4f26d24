"""The tier backends (G2 host, G3 disk, G3.5 Redis or shared dir, G4 shared dir) behind the
kv.tiers.base.TierBackend interface, and the block codec they all store. Names load on first use
(PEP 562), so importing one backend does not import the others or redis-py."""
from importlib import import_module

_WHERE = {
    "CorruptBlock": "codec", "DecodedBlock": "codec", "FormatMismatch": "codec", "decode_block": "codec",
    "encode_block": "codec",
    "DiskTier": "disk", "HostTier": "host", "RedisTier": "redis_store", "SharedDirTier": "shared_dir",
    "PoolCodec": "pool_codec", "encode_pool_block": "pool_codec", "load_pool_block": "pool_codec",
}       # pool_codec() is not here: `pool_codec` names its module (from everybyte.kv.data.tiers.pool_codec import pool_codec)
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
