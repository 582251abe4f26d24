"""What a step and a tier transfer cost on the catalog's hardware: a roofline.

step time = max(FLOPs / peak FLOP/s of the compute format, bytes / HBM bandwidth) + overhead, where
FLOPs = 2 x active parameters x tokens computed + attention over each token's context, and bytes =
the weights read once per step (for MoE only the experts the batch's tokens reach, in expectation)
+ every computed token's KV context read + the new tokens' KV written. A worker of g GPUs divides
both by g (ideal tensor/expert parallelism: no communication cost yet). A tier transfer costs
latency + bytes / bandwidth. The fit that replaces these assumptions with measured ones is
`sim calibrate` (not built yet); every assumption is listed by describe().
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from everybyte.sim.calibration import StepFit
from everybyte.sim.expert_parallel import ExpertParallel
from everybyte.sim.hardware import Hardware
from everybyte.sim.models import ModelShape


@dataclass
class TierLink:
    bytes_per_s: float                        # reads (loads into G1)
    latency_s: float = 0.0
    write_bytes_per_s: float | None = None    # writes (offloads, spills, write-through); None: as reads

    @property
    def write_rate(self) -> float:
        return self.write_bytes_per_s or self.bytes_per_s


class CostModel:
    def __init__(self, hw: Hardware, model: ModelShape, weights_format: str = "bf16", kv_format: str = "bf16",
                 gpus: int = 1, step_overhead_s: float = 0.0, calibration: StepFit | None = None,
                 ep: ExpertParallel | None = None, token_weight: float = 1.0):
        """calibration: a step-time fit to the real engine (sim.calibration) used instead of the
        roofline; steps outside the shapes it was fitted on are counted (outside_range).
        ep: expert parallelism over the worker's GPUs (sim.expert_parallel) instead of ideal scaling.
        token_weight: a scaled-down trace's context token stands for this many real ones (its KV
        bytes, the attention over it and its prefill cost that many times; decode tokens are real)."""
        if gpus < 1:
            raise ValueError(f"gpus per worker must be >= 1, got {gpus}")
        if ep is not None and ep.gpus != gpus:
            raise ValueError(f"EP{ep.gpus} needs a worker of {ep.gpus} GPUs, got {gpus}")
        if not token_weight >= 1:
            raise ValueError(f"token_weight must be >= 1, got {token_weight}")
        self.ep, self.token_weight = ep, token_weight
        self.hw, self.model, self.gpus = hw, model, gpus
        self.weights_format, self.kv_format = weights_format, kv_format
        self.peak_flops, self.compute_format = hw.flops(weights_format if weights_format != "bf16" else "fp16")
        self.gpu_flops, self.gpu_hbm_bw = self.peak_flops, hw.need("hbm_bytes_per_s")
        self.peak_flops *= gpus
        self.hbm_bw = self.gpu_hbm_bw * gpus
        self.step_overhead_s = step_overhead_s
        self.calibration, self.outside_range = calibration, 0
        rng = calibration.range() if calibration else {}
        self._limits: list[tuple[str, int, int]] = [(key, rng[key][0], rng[key][1])
                                                     for key in ("tokens", "attended", "seqs") if key in rng]
        parts = model.weight_bytes(weights_format)
        self.expert_bytes, self.routed_bytes = parts["expert"], parts["routed_experts"]
        self.expert_params = sum(r * c for r, c in model.mlp_matrices(model.moe_mlp)) if model.moe_layers else 0
        self.fixed_weight_bytes = sum(v for k, v in parts.items() if k not in ("expert", "routed_experts"))
        self.kv_token_bytes = int(model.kv_bytes_per_token(kv_format) * token_weight)
        self.flops_per_token = 2 * model.active_params()
        self.attn_flops_per_ctx = 2 * model.layers * model.heads * (model.qk_dim + model.v_dim)
        self.tiers: dict[str, TierLink] = {}
        if (host := hw.get("host_bytes_per_s")) is not None:
            self.tiers["G2"] = TierLink(host * gpus)
        for level, link in (calibration.tiers if calibration else {}).items():
            self.tiers[level] = TierLink(link["bytes_per_s"], link.get("latency_s", 0.0))     # measured wins
        self._touched: dict[float, float] = {}

    # ---- memory -------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        if self.ep is not None:
            return self.ep.worker_weight_bytes(self.fixed_weight_bytes, self.routed_bytes)
        return self.model.total_weight_bytes(self.weights_format)

    def device_bytes(self) -> int:
        return int(self.hw.need("hbm_bytes") * self.gpus)

    def kv_budget(self, utilization: float = 0.9) -> int:
        """Device bytes left for KV after the weights at `utilization` of memory; an error saying
        how many bytes are missing when the weights do not fit."""
        usable, weights = int(self.device_bytes() * utilization), self.weight_bytes()
        if weights >= usable:
            raise ValueError(
                f"{self.model.name} in {self.weights_format} needs {weights} bytes of weights; {self.gpus} x "
                f"{self.hw.name} at {utilization:g} memory utilization holds {usable}: {weights - usable} bytes "
                f"missing (more --gpus-per-worker, a smaller --weights-format, or higher utilization)")
        return usable - weights

    # ---- steps --------------------------------------------------------------------------------
    def experts_touched(self, tokens: float) -> float:
        """Expected distinct routed experts per MoE layer that `tokens` tokens reach (uniform top-k)."""
        m = self.model
        got = self._touched.get(tokens)
        if got is None:
            got = self._touched[tokens] = float(m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens))
        return got

    def step_seconds(self, tokens: float, attended: float, new_kv: float | None = None) -> float:
        """tokens: computed this step (prefill chunks + one per decoding sequence); attended: sum over
        them of the context each attends to (its position + 1), in trace tokens (each token_weight
        real ones: kv_token_bytes already counts them, the attention FLOPs here); new_kv: trace
        tokens whose KV is written (default tokens)."""
        if tokens <= 0:
            return 0.0
        new_kv = tokens if new_kv is None else new_kv
        if self.ep is not None:
            return self.ep.step_seconds(self, tokens, attended, new_kv) + self.step_overhead_s
        weights = float(self.fixed_weight_bytes)
        if self.model.moe_layers:
            weights += self.model.moe_layers * self.experts_touched(tokens) * self.expert_bytes
        nbytes = weights + (attended + new_kv) * self.kv_token_bytes
        flops = tokens * self.flops_per_token + attended * self.token_weight * self.attn_flops_per_ctx
        return max(flops / self.peak_flops, nbytes / self.hbm_bw) + self.step_overhead_s

    def batch_seconds(self, seqs: Sequence[Any], num_new_tokens: Sequence[int]) -> float:
        tokens = attended = prefill = 0
        for s, n in zip(seqs, num_new_tokens):
            c = s.num_computed_tokens
            tokens += n
            attended += n * c + n * (n + 1) // 2          # token i of the chunk sees c + i + 1 positions
            if self.token_weight != 1:
                prefill += max(min(n, s.num_prompt_tokens - c), 0)
        self.count_shape(tokens, attended, len(seqs))
        return self._seconds(tokens, attended, len(seqs), prefill)

    def decode_seconds(self, num_seqs: int, attended: int) -> float:
        """batch_seconds of a pure decode batch (one token each, `attended` context in all), without
        counting its shape (count_shape does, when the step runs)."""
        return self._seconds(num_seqs, attended, num_seqs, 0)

    def decode_run_seconds(self, num_seqs: int, attended: int, steps: int) -> list[float]:
        """decode_seconds of `steps` pure decode steps, the context one longer per sequence each
        step: on the roofline the same float operations in the same order, hoisted out of the loop
        (a run's times must equal the single steps' to the bit)."""
        if self.calibration is not None or self.ep is not None or num_seqs <= 0:
            return [self.decode_seconds(num_seqs, attended + num_seqs * j) for j in range(steps)]
        n, w = num_seqs, self.token_weight
        tokens = n + 0 * (w - 1)                           # _seconds with no prefill
        weights = float(self.fixed_weight_bytes)
        if self.model.moe_layers:
            weights += self.model.moe_layers * self.experts_touched(tokens) * self.expert_bytes
        kvb, afc, peak, bw, over = self.kv_token_bytes, self.attn_flops_per_ctx, self.peak_flops, self.hbm_bw, \
            self.step_overhead_s
        base = tokens * self.flops_per_token
        out = []
        fa, fn = float(attended), float(n)                 # exact (< 2**53): a float loop, no int conversions
        for j in range(steps):                             # range(steps): a native loop compiled
            a = fa + fn * j
            out.append(max((base + a * w * afc) / peak, (weights + (a + fn) * kvb) / bw) + over)
        return out

    def count_decode(self, num_seqs: int, attended: int, steps: int) -> None:
        """count_shape of each step of a decode run (nothing to count without a calibration)."""
        if self._limits:
            for j in range(steps):
                self.count_shape(num_seqs, attended + num_seqs * j, num_seqs)

    def count_shape(self, tokens: int, attended: int, seqs: int) -> None:
        """Count a step outside the calibrated shapes (when calibrated)."""
        if self._limits:
            shape = {"tokens": tokens, "attended": attended, "seqs": seqs}
            if any(not lo <= shape[key] <= hi for key, lo, hi in self._limits):
                self.outside_range += 1

    def _seconds(self, tokens: int, attended: int, seqs: int, prefill: int) -> float:
        if self.calibration is not None:
            return self.calibration.seconds(tokens, attended, seqs)
        w = self.token_weight
        return self.step_seconds(tokens + prefill * (w - 1), attended, tokens)

    # ---- tiers --------------------------------------------------------------------------------
    def transfer_seconds(self, level: str, nbytes: int) -> float:
        link = self.tiers.get(level)
        if link is None:
            raise ValueError(f"hardware {self.hw.name!r} has no sourced bandwidth for tier {level}; "
                             f"tiers it has: {', '.join(self.tiers) or 'none'}")
        return link.latency_s + nbytes / link.bytes_per_s

    def write_seconds(self, level: str, nbytes: int) -> float:
        """A write of nbytes to `level` (its link's write bandwidth: the links are full duplex)."""
        link = self.tiers[level]
        return link.latency_s + nbytes / link.write_rate

    def describe(self) -> dict[str, Any]:
        return {"hardware": self.hw.name, "gpus_per_worker": self.gpus, "compute_format": self.compute_format,
                "peak_flops": self.peak_flops, "hbm_bytes_per_s": self.hbm_bw,
                "weights_format": self.weights_format, "kv_format": self.kv_format,
                "weight_bytes": self.weight_bytes(), "kv_bytes_per_token": self.kv_token_bytes,
                "step_overhead_s": self.step_overhead_s, "token_weight": self.token_weight,
                "expert_parallel": None if self.ep is None else self.ep.describe(),
                "step_time": "calibrated fit (sim calibrate)" if self.calibration else "roofline",
                "calibration": None if self.calibration is None else {
                    "coefficients": self.calibration.coefficients, "residuals": self.calibration.residuals,
                    "samples": self.calibration.samples, "source": self.calibration.source},
                "tiers": {k: {"bytes_per_s": v.bytes_per_s, "latency_s": v.latency_s,
                          "write_bytes_per_s": v.write_rate} for k, v in self.tiers.items()},
                "assumptions": [
                    "roofline per step: max(FLOPs / peak, bytes / HBM bandwidth) + a fixed overhead",
                    "weights read once per step; MoE: expected distinct experts reached by the batch (uniform top-k)",
                    "every computed token reads its whole KV context; new KV written once",
                    "a worker of g GPUs scales FLOP/s and bandwidth by g: no communication cost",
                    "a weights format without a FLOP/s figure computes at the next wider format's",
                    "tier latency 0 where no latency is sourced; a calibration's measured tier loads replace "
                    "the catalog's links",
                    "calibrated step times replace the roofline only with --calibration; outside the "
                    "fitted shapes they extrapolate (counted in the run's summary)"]}
