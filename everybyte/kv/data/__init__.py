"""KV data: the G1 pool's tensors, the block loader (the real kv.mover.KVMover), the tier
backends and block codecs (tiers/) and the tier construction from --kv-tiers. These import torch;
the KV control plane in kv/ never imports them (the memory manager reaches the loader through
kv.mover.pool_mover, lazily)."""
