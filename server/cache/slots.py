"""Pool of KDA recurrent-state slots, with slot 0 kept back as the scratch slot.

Why a scratch slot: a padded batch still scatters every row's state back to ``slot_ids``;
rows carrying no tokens leave their slot's value unchanged, but a scatter with duplicate
indices has no defined order, so a padding row must never name a slot a live request owns.
Slot ``SCRATCH`` (0) is never handed out and is what padding rows use. Slots need no reset
between requests: a row with ``start_pos == 0`` starts from a zero state whatever its slot held.

Layout this pool indexes (``k3serve.model.cache``), both float32 whatever the model dtype:
  kda_state [nK, num_slots, H, dk, dv]     recurrent state S[k, v] per KDA layer
  kda_conv  [nK, num_slots, W-1, 3*H*dk]   short-conv window, oldest first
A slot id is the same index in every KDA layer. Capacity is ``num_slots - 1`` requests.
"""
from __future__ import annotations

SCRATCH = 0


class SlotPool:
    SCRATCH = SCRATCH

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot {SCRATCH} is the scratch slot), got {num_slots}")
        self.num_slots = int(num_slots)
        self._used = [False] * self.num_slots
        self._used[SCRATCH] = True  # permanently taken
        self._free = list(range(self.num_slots - 1, 0, -1))  # stack: a fresh pool hands out 1, 2, ...

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots held by requests (the scratch slot is not counted)."""
        return self.capacity - len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        s = self._free.pop()
        self._used[s] = True
        return s

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        if slot == SCRATCH:
            raise ValueError(f"slot {SCRATCH} is the scratch slot and is never allocated")
        if not self._used[slot]:
            raise ValueError(f"double free of slot {slot}")
        self._used[slot] = False
        self._free.append(slot)

    def is_used(self, slot: int) -> bool:
        return self._used[slot]

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "slot free list holds duplicates"
        assert SCRATCH not in free, "scratch slot is on the free list"
        for s in range(1, self.num_slots):
            assert self._used[s] != (s in free), f"slot {s}: used={self._used[s]} but {'in' if s in free else 'not in'} free list"
