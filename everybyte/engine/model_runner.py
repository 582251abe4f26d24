"""Turns a scheduled batch into one forward over the paged KV pool, then samples."""
from __future__ import annotations

import torch

from everybyte.engine.exact_tail import exact_tail_for
from everybyte.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from everybyte.engine.sequence import Sequence
from everybyte.kv.data.pool import KVPool, min_pool_bytes
from everybyte.models.attention import AttentionMetadata, LayerKVCache
from everybyte.models.threads import one_thread

# Mixed prose, code, numbers and chat markup: a fixed, ordinary input for scale calibration.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong and Buzz Aldrin walked on its surface while Michael Collins orbited above.\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b, out = 0, 1, []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "User: What is the capital of France, and why is it famous?\nAssistant: Paris is the capital "
    "of France. It is famous for the Eiffel Tower, the Louvre, its cafes and 2,000 years of history.\n"
    "| year | revenue | growth |\n|------|---------|--------|\n| 2021 | $4.2M | 12% |\n"
    "Les donnees sont stockees dans un cache; 東京は日本の首都です。 SELECT id, name FROM users;\n"
)


CALIBRATION_BLOCK_SIZE = 16


def calibrate_kv_amax(model, layer_shapes: list[tuple[int, int]], token_ids: list[int],
                      block_size: int = CALIBRATION_BLOCK_SIZE) -> tuple[list[float], list[float]]:
    """Per-layer K and V absolute maxima from one fp32-KV forward pass over fixed tokens.

    Why this way: the fp8/nvfp4 per-layer FP32 scales must be fixed before any request runs
    (every block of a layer shares one scale, and blocks are named by their bytes, so the same
    model must always produce the same scales). A calibration pass over a fixed, ordinary text
    with an exact fp32 cache costs one short prefill at startup, needs no data outside the model,
    and measures the activations the format must actually cover (K after RoPE and norms, V as
    stored). The caller adds headroom for inputs that go beyond this text; values past it
    saturate rather than overflow.

    Deterministic: the pass runs on one CPU thread, so no GEMM, attention or C kernel splits its
    sums by the thread count (or by how many threads a loaded machine lets it have), and its
    input (tokens, one sequence, block size) depends on nothing the engine is configured with.
    The same model on the same kind of machine and library build gives bit-identical maxima in
    every process; KVPool.set_scales_from_amax's power-of-two grid then absorbs the ~1e-6
    relative differences left between CPUs or GEMM libraries (README: KV cache formats).
    """
    n = len(token_ids)
    with one_thread():
        pool = KVPool(layer_shapes, "fp32", min_pool_bytes(layer_shapes, "fp32", n, block_size), block_size)
        runner = ModelRunner(model, pool)
        seq = Sequence(token_ids)
        seq.block_table = list(range(pool.num_blocks))
        runner.forward([seq], [n], logits="none")
        blocks = torch.arange(pool.num_blocks)
        read = lambda store: pool.fmt.read(store, blocks, 1.0).abs().amax().item()
        return [read(k) for k in pool.k], [read(v) for v in pool.v]


class ModelRunner:
    def __init__(self, model, pool: KVPool, sampler: Sampler | None = None, exact_tail: bool = True):
        self.model = model
        self.pool = pool
        self.block_size = pool.block_size
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.sampler = sampler or Sampler()
        self.exact_tail = exact_tail_for(pool, next(model.parameters()).dtype, self.device, exact_tail)
        self.kv_caches: list[LayerKVCache] = []
        self.refresh_caches()

    def refresh_caches(self) -> None:
        p = self.pool
        self.kv_caches = [LayerKVCache(p.fmt, p.k[i], p.v[i], p.k_scales[i], p.v_scales[i], p.block_size,
                                       *self.exact_tail.layer(i))
                          for i in range(p.num_layers)]

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        bs = self.block_size
        input_ids, positions, slots, context_lens = [], [], [], []
        for seq, n in zip(seqs, num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            context_lens.append(end)
            table = seq.block_table
            stored = seq.kv_stored_until        # a reused block recomputed for the exact tail keeps its bytes
            if n == 1 and start >= stored:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs if p >= stored else -1 for p in range(start, end))
        max_blocks = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs]
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)
        tail_slots, grown = self.exact_tail.begin_step(seqs)
        if grown:
            self.refresh_caches()
        meta = AttentionMetadata(slot_mapping=as_long(slots), query_lens=list(num_new_tokens),
                                 context_lens=context_lens, block_tables=as_long(tables), tail_slots=tail_slots)
        return as_long(input_ids), as_long(positions), meta

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], num_new_tokens: list[int], logits: str = "last",
                rows: list[int] | None = None) -> torch.Tensor | None:
        """One forward over the batch. logits: "last" (last new token of each row in `rows`,
        default all rows), "all" (every new token) or "none"."""
        input_ids, positions, meta = self.prepare(seqs, num_new_tokens)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        self.exact_tail.end_step(seqs, num_new_tokens)
        if logits == "none":
            return None
        if logits == "all":
            return self.model.compute_logits(hidden)
        ends = torch.tensor(num_new_tokens).cumsum(0) - 1
        if rows is not None:
            ends = ends[rows]
        return self.model.compute_logits(hidden[ends.to(self.device)])

    def run(self, seqs: list[Sequence], num_new_tokens: list[int],
            generators: list[torch.Generator | None]) -> tuple[list[int], SamplerOutput | None]:
        """Forward the batch and sample one token for every sequence whose chunk reaches its end.
        Returns the rows sampled and the sampler output for them."""
        rows = [i for i, (seq, n) in enumerate(zip(seqs, num_new_tokens))
                if seq.num_computed_tokens + n == len(seq)]
        if not rows:
            self.forward(seqs, num_new_tokens, logits="none")
            return rows, None
        logits = self.forward(seqs, num_new_tokens, rows=rows)
        st = SamplingTensors.from_params([seqs[i].params for i in rows], logits.shape[-1],
                                         [seqs[i].token_ids for i in rows])
        return rows, self.sampler(logits.cpu(), st, [generators[i] for i in rows])
