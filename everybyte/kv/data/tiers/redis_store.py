"""G3.5: a pod-shared block store in Redis/Valkey through redis-py.

Keys live under a prefix: `<prefix>b:<name hex>` holds a framed block (checksum checked on read),
`<prefix>lru` (sorted set, last access time), `<prefix>sizes` (hash) and `<prefix>used` (byte
counter) account the capacity shared by every process of the pod. Puts run as one Lua script that
evicts least recently used blocks until the new one fits. An optional TTL expires blocks (renewed
on each hit); expired blocks are dropped from the accounting when they reach the LRU end.
Redis down -> misses and failed puts, logged once, counted; calls are retried after `retry_s`.
"""
from __future__ import annotations

import time

from everybyte.kv.data.tiers.buffers import as_bytes_view
from everybyte.kv.tiers.base import TierBackend, log
from everybyte.kv.tiers.frame import frame_header, unframe

_PUT = """
local key, lru, sizes, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, n, now, ttl, cap, dprefix = ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
if redis.call('EXISTS', key) == 1 then
  redis.call('ZADD', lru, now, member)
  return {0, {}}
end
local old = redis.call('HGET', sizes, member)
if old then redis.call('DECRBY', used, old) end
local total = tonumber(redis.call('GET', used) or '0')
local evicted = {}
while total + n > cap do
  local victim = redis.call('ZRANGE', lru, 0, 0)[1]
  if not victim then break end
  local vs = tonumber(redis.call('HGET', sizes, victim) or '0')
  redis.call('DEL', dprefix .. victim)
  redis.call('ZREM', lru, victim)
  redis.call('HDEL', sizes, victim)
  total = redis.call('DECRBY', used, vs)
  table.insert(evicted, victim)
end
if ttl > 0 then redis.call('SET', key, ARGV[1], 'EX', ttl) else redis.call('SET', key, ARGV[1]) end
redis.call('HSET', sizes, member, n)
redis.call('INCRBY', used, n)
redis.call('ZADD', lru, now, member)
return {1, evicted}
"""             # evicted: the names (hex) of the blocks dropped to make room

_DELETE = """
local n = redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('DECRBY', KEYS[4], size)
  redis.call('HDEL', KEYS[3], ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return n
"""


class RedisTier(TierBackend):
    kind = "redis"

    def __init__(self, url: str, capacity_bytes: int, level: str = "G3.5", prefix: str = "everybyte:kv:",
                 ttl_s: int | None = None, retry_s: float = 1.0, timeout_s: float = 1.0, on_evict=None):
        import redis
        super().__init__(capacity_bytes, level, on_evict)
        self.url, self.prefix, self.ttl_s, self.retry_s = url, prefix, ttl_s, retry_s
        self._redis_errors = (redis.exceptions.RedisError, OSError)
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._put_script = self.r.register_script(_PUT)
        self._delete_script = self.r.register_script(_DELETE)
        self._lru, self._sizes, self._used_key = prefix + "lru", prefix + "sizes", prefix + "used"
        self._down_until = 0.0
        self._down = False
        self._last_used = 0
        self._last_len = 0

    def key(self, name: bytes) -> str:
        return f"{self.prefix}b:{name.hex()}"

    def _keys(self, name: bytes) -> list[str]:
        return [self.key(name), self._lru, self._sizes, self._used_key]

    def _call(self, fn, default):
        """Run fn(); on an outage count it, log once, and answer `default` until retry_s passed."""
        if time.monotonic() < self._down_until:
            return default
        try:
            out = fn()
        except self._redis_errors as e:
            self.stats.add("errors")
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                log.warning("redis tier %s unavailable (%s); its blocks are misses until it returns",
                            self.url, e)
            return default
        if self._down:
            self._down = False
            log.warning("redis tier %s is back", self.url)
        return out

    @property
    def available(self) -> bool:
        return not self._down

    def put(self, name, data) -> bool:
        payload = as_bytes_view(data)
        value = frame_header(payload) + payload.tobytes()
        if len(value) > self.capacity_bytes:
            self.stats.add("rejected")
            return False
        args = [value, name.hex(), len(value), time.time(), int(self.ttl_s or 0), self.capacity_bytes,
                self.prefix + "b:"]
        res = self._call(lambda: self._put_script(keys=self._keys(name), args=args), None)
        if res is None:
            return False
        stored, evicted = int(res[0]), [bytes.fromhex(v.decode() if isinstance(v, bytes) else v) for v in res[1]]
        if evicted:       # counted, and reported (TierSet turns it into BlockRemoved events)
            self._evicted(evicted, [None] * len(evicted))
        if stored:
            self.stats.add("puts")
            self.stats.add("bytes_written", len(value))
        return True

    def get(self, name):
        return self.get_many([name])[0]

    def get_many(self, names) -> list:
        """All values in one pipelined round trip (each touched in the LRU, TTL renewed)."""
        if not names:
            return []

        def fetch():
            p, now = self.r.pipeline(transaction=False), time.time()
            for name in names:
                p.get(self.key(name))
            p.zadd(self._lru, {n.hex(): now for n in names}, xx=True)
            for name in names if self.ttl_s else ():
                p.expire(self.key(name), int(self.ttl_s))
            return p.execute()[:len(names)]
        out = []
        for name, value in zip(names, self._call(fetch, None) or [None] * len(names)):
            payload = None if value is None else unframe(value)
            if value is not None and payload is None:
                self.stats.add("corrupt")
                self._warn_once("corrupt", "redis tier %s: corrupt block %s deleted (further ones only counted)",
                                self.url, name.hex())
                self._call(lambda: self._delete_script(keys=self._keys(name), args=[name.hex()]), 0)
            self.stats.add("hits" if payload is not None else "misses")
            if payload is not None:
                self.stats.add("bytes_read", len(value))
            out.append(payload)
        return out

    def contains(self, name) -> bool:
        return bool(self._call(lambda: self.r.exists(self.key(name)), 0))

    def contains_many(self, names) -> list[bool]:
        names = list(names)

        def check():
            p = self.r.pipeline(transaction=False)
            for n in names:
                p.exists(self.key(n))
            return [bool(x) for x in p.execute()]
        return self._call(check, [False] * len(names))

    def longest_prefix(self, names) -> int:
        found = self.contains_many(names)
        return found.index(False) if False in found else len(found)

    def delete(self, name) -> bool:
        n = self._call(lambda: self._delete_script(keys=self._keys(name), args=[name.hex()]), 0)
        if n:
            self.stats.add("deletes")
        return bool(n)

    @property
    def used_bytes(self) -> int:
        v = self._call(lambda: int(self.r.get(self._used_key) or 0), None)
        if v is not None:
            self._last_used = v
        return self._last_used

    def __len__(self):
        v = self._call(lambda: self.r.zcard(self._lru), None)
        if v is not None:
            self._last_len = v
        return self._last_len

    def clear(self) -> None:
        """Delete every key under this tier's prefix (tests, resets)."""
        def wipe():
            keys = list(self.r.scan_iter(match=self.prefix + "*", count=1000))
            for i in range(0, len(keys), 1000):
                self.r.delete(*keys[i:i + 1000])
        self._call(wipe, None)

    def close(self) -> None:
        try:
            self.r.close()
        except self._redis_errors:
            pass
