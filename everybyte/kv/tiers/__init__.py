"""Tiers below the device (G2 host, G3 disk, G3.5 Redis or shared dir, G4 shared dir) and the
block codec they all store. redis-py is imported only when a Redis tier is built."""
from everybyte.kv.tiers.base import TierBackend, TierStats, io_executor
from everybyte.kv.tiers.codec import CorruptBlock, DecodedBlock, FormatMismatch, decode_block, encode_block
from everybyte.kv.tiers.disk import DiskTier
from everybyte.kv.tiers.host import HostTier
from everybyte.kv.tiers.pool_codec import PoolCodec, encode_pool_block, load_pool_block, pool_codec
from everybyte.kv.tiers.redis_store import RedisTier
from everybyte.kv.tiers.shared_dir import SharedDirTier

__all__ = ["TierBackend", "TierStats", "io_executor", "CorruptBlock", "DecodedBlock", "FormatMismatch",
           "decode_block", "encode_block", "encode_pool_block", "load_pool_block", "PoolCodec", "pool_codec",
           "DiskTier", "HostTier", "RedisTier", "SharedDirTier"]
