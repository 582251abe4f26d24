"""Where one MoE layer's experts live: physical slots across ranks, each holding a logical expert.

Rank r holds physical slots [r * slots_per_rank, (r + 1) * slots_per_rank); a logical expert may
sit in more than one slot (a redundant replica, EPLB). The identity placement splits the experts
contiguously, one slot each. A MoEBlock's `experts` are its rank's slots, in slot order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ExpertPlacement:
    num_logical: int
    num_ranks: int
    rank: int
    physical_to_logical: list[int]     # len num_ranks * slots_per_rank
    slots_per_rank: int
    _lookup: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.physical_to_logical = [int(e) for e in self.physical_to_logical]
        if self.num_logical <= 0 or self.num_ranks <= 0 or self.slots_per_rank <= 0:
            raise ValueError(f"placement needs num_logical, num_ranks and slots_per_rank > 0, got "
                             f"{self.num_logical}, {self.num_ranks}, {self.slots_per_rank}")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"rank {self.rank} outside 0..{self.num_ranks - 1}")
        if len(self.physical_to_logical) != self.num_ranks * self.slots_per_rank:
            raise ValueError(f"physical_to_logical has {len(self.physical_to_logical)} slots, expected "
                             f"num_ranks * slots_per_rank = {self.num_ranks * self.slots_per_rank}")
        bad = sorted({e for e in self.physical_to_logical if not 0 <= e < self.num_logical})
        if bad:
            raise ValueError(f"physical_to_logical names experts {bad} outside 0..{self.num_logical - 1}")
        absent = sorted(set(range(self.num_logical)) - set(self.physical_to_logical))
        if absent:
            raise ValueError(f"experts {absent} have no slot in the placement")

    @classmethod
    def identity(cls, num_logical: int, num_ranks: int = 1, rank: int = 0) -> ExpertPlacement:
        """Expert e in slot e: rank r holds experts [r * E/N, (r + 1) * E/N)."""
        if num_ranks <= 0 or num_logical % num_ranks:
            divisors = [n for n in range(1, num_logical + 1) if num_logical % n == 0]
            raise ValueError(f"{num_ranks} ranks do not divide {num_logical} experts; the rank count must "
                             f"be one of {divisors}")
        return cls(num_logical, num_ranks, rank, list(range(num_logical)), num_logical // num_ranks)

    @property
    def num_local_slots(self) -> int:
        return self.slots_per_rank

    @property
    def local_logical(self) -> list[int]:
        """The logical expert in each of this rank's slots."""
        first = self.rank * self.slots_per_rank
        return self.physical_to_logical[first:first + self.slots_per_rank]

    def replicas(self, logical: int) -> list[int]:
        """Physical slots holding expert `logical`."""
        return [p for p, e in enumerate(self.physical_to_logical) if e == logical]

    def local_slots_of(self, logical: int) -> list[int]:
        """This rank's local slot indices holding expert `logical` (empty: not here)."""
        return [s for s, e in enumerate(self.local_logical) if e == logical]

    def rank_of_slot(self, physical: int) -> int:
        return physical // self.slots_per_rank

    def to_local_slots(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Logical ids (any shape) -> this rank's first local slot holding each, -1 where none does
        (only meaningful when every expert is local: otherwise tokens must be dispatched)."""
        table = self._lookup.get(logical_ids.device)
        if table is None:
            local = [-1] * self.num_logical
            for s, e in reversed(list(enumerate(self.local_logical))):
                local[e] = s
            table = self._lookup[logical_ids.device] = torch.tensor(local, dtype=torch.long,
                                                                    device=logical_ids.device)
        return table[logical_ids]
