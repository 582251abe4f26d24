"""Micro-benchmarks over internals: `everybyte bench formats|disk-reader|kv-quality|weights-quality|memory`.

The rest of everybyte/bench uses public interfaces only (HTTP, `LLM`, `SamplingParams`,
the engine config; DESIGN.md). These benchmarks measure a part by nature and are exempt:
a codec (formats), the disk tier's reader (disk_reader), teacher-forced logits over the paged
attention path (kv_quality, weights_quality: each variant's loader and weight layouts) and the
memory system inside the engine (memory: prompt tokens computed counted at the scheduler, the
G1 ledger from the block manager, each tier's load through the engine's BlockLoader).
"""
