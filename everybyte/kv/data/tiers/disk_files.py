"""The disk tier's files. One block put alone is `<name>.kvb`: a frame (buffers.FRAME, with a
checksum) then the block. A batch is one pack `<id>.kvp`: a header (magic, block count, checksum
of the table), a table of (name, offset, framed size), then each block framed as above. Temp files
(TMP_PREFIX) are written first and renamed into place."""
from __future__ import annotations

import struct

from everybyte.kv.tiers.frame import FRAME, checksum, frame_header

SUFFIX, PACK_SUFFIX = ".kvb", ".kvp"
TMP_PREFIX = ".tmp-"
PACK = struct.Struct("<4sIQ")          # magic, blocks, checksum of the table
ENTRY = struct.Struct("<16sQQ")        # name, offset, framed size
PACK_MAGIC = b"EBP2"


def file_parts(new: list[tuple[bytes, memoryview]]) -> tuple[list, dict[bytes, tuple[int, int]]]:
    """The byte parts of the file holding `new` [(name, payload)] (one block: a .kvb, more: a pack),
    and {name: (offset, framed size)} within it."""
    if len(new) == 1:
        name, payload = new[0]
        return [frame_header(payload), payload], {name: (0, FRAME.size + len(payload))}
    off, blocks = PACK.size + ENTRY.size * len(new), {}
    for name, payload in new:
        blocks[name] = (off, FRAME.size + len(payload))
        off += FRAME.size + len(payload)
    table = b"".join(ENTRY.pack(n, o, s) for n, (o, s) in blocks.items())
    parts = [PACK.pack(PACK_MAGIC, len(new), checksum(table)), table]
    for _, payload in new:
        parts += [frame_header(payload), payload]
    return parts, blocks


def read_pack_table(path: str) -> dict | None:
    """A pack file's {name: (offset, framed size)}, None when its table is damaged."""
    with open(path, "rb") as f:
        head = f.read(PACK.size)
        if len(head) < PACK.size:
            return None
        magic, count, crc = PACK.unpack(head)
        table = f.read(ENTRY.size * count)
    if magic != PACK_MAGIC or len(table) != ENTRY.size * count or checksum(table) != crc:
        return None
    return {n: (o, s) for n, o, s in ENTRY.iter_unpack(table)}
