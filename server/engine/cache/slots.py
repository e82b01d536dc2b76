"""Pool of KDA recurrent-state slots: one scratch slot per DP group, request slots, and
prefix-snapshot slots.

Layout this pool indexes (``k3serve.model.cache``), both float32 whatever the model dtype:
  kda_state [nK, num_slots, H, dk, dv]     recurrent state S[k, v] per KDA layer
  kda_conv  [nK, num_slots, (W-1)*3*H, dk] short-conv window, oldest first (``conv_pool_rows``)
A slot id is the same index in every KDA layer.

The ids are cut into ``groups`` equal ranges, one per attention-DP group (the slot dim is
split over the mesh's ``"dp"`` axis; one range without DP). Each range is, in order:

* its **scratch** slot (the first; ``SCRATCH`` = 0 for group 0), never handed out. A padded
  batch still scatters every row's state back to ``slot_ids``; rows carrying no tokens leave
  their slot unchanged, but a scatter with duplicate indices has no defined order, so padding
  rows point at their group's scratch slot, which no request owns;
* **request** slots, handed out by ``alloc(group)`` / ``free``;
* the last ``snapshots / groups`` slots: **snapshot** slots for the prefix cache, with their
  own free list (``alloc_snapshot`` / ``free_snapshot``), so the prefix cache can never take a
  slot a request needs, nor the reverse. Same arrays, so a registration or a hit is one
  on-device copy between two slot indices.

``capacity`` (concurrent requests) is therefore ``num_slots - groups * (1 + snapshots per
group)``. Slots need no reset between requests: a row with ``start_pos == 0`` starts from a
zero state whatever its slot held.
"""
from __future__ import annotations

SCRATCH = 0


class SlotPool:
    SCRATCH = SCRATCH

    def __init__(self, num_slots: int, groups: int = 1, snapshots: int = 0):
        if groups < 1 or num_slots % groups:
            raise ValueError(f"{num_slots} slots do not split into {groups} equal groups")
        if snapshots < 0 or snapshots % groups:
            raise ValueError(f"{snapshots} snapshot slots do not split into {groups} equal groups")
        per = num_slots // groups
        snap = snapshots // groups
        if per - snap < 2:
            raise ValueError(f"num_slots must be >= 2 per group beside the snapshot slots (the first is the scratch "
                             f"slot), got {num_slots} with {snapshots} snapshot slots for {groups} group(s)")
        self.num_slots = int(num_slots)
        self.groups = int(groups)
        self.per_group = per
        self.snapshots_per_group = snap
        self._used = [False] * self.num_slots
        for g in range(groups):
            self._used[g * per] = True  # each group's scratch slot: permanently taken
        # stacks: a fresh pool hands out 1, 2, ... within each group
        self._frees = [list(range((g + 1) * per - 1 - snap, g * per, -1)) for g in range(groups)]
        self._snap_frees = [list(range((g + 1) * per - 1, (g + 1) * per - 1 - snap, -1)) for g in range(groups)]

    @property
    def capacity(self) -> int:
        """Request slots (scratch and snapshot slots not counted)."""
        return self.num_slots - self.groups * (1 + self.snapshots_per_group)

    def is_snapshot(self, slot: int) -> bool:
        return slot % self.per_group >= self.per_group - self.snapshots_per_group

    @property
    def num_free_snapshots(self) -> int:
        return sum(len(f) for f in self._snap_frees)

    @property
    def num_snapshots_used(self) -> int:
        return self.groups * self.snapshots_per_group - self.num_free_snapshots

    def alloc_snapshot(self, group: int = 0) -> int | None:
        free = self._snap_frees[group]
        if not free:
            return None
        s = free.pop()
        self._used[s] = True
        return s

    def free_snapshot(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots and self.is_snapshot(slot)):
            raise ValueError(f"slot {slot} is not a snapshot slot")
        if not self._used[slot]:
            raise ValueError(f"double free of snapshot slot {slot}")
        self._used[slot] = False
        self._snap_frees[self.group_of(slot)].append(slot)

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._frees)

    def num_free_in(self, group: int) -> int:
        return len(self._frees[group])

    @property
    def num_used(self) -> int:
        """Slots held by requests (the scratch slots are not counted)."""
        return self.capacity - self.num_free

    def scratch_of(self, group: int) -> int:
        return group * self.per_group

    def group_of(self, slot: int) -> int:
        return slot // self.per_group

    def alloc(self, group: int = 0) -> int | None:
        free = self._frees[group]
        if not free:
            return None
        s = free.pop()
        self._used[s] = True
        return s

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        if slot % self.per_group == 0:
            raise ValueError(f"slot {slot} is a scratch slot and is never allocated")
        if self.is_snapshot(slot):
            raise ValueError(f"slot {slot} is a snapshot slot (free_snapshot)")
        if not self._used[slot]:
            raise ValueError(f"double free of slot {slot}")
        self._used[slot] = False
        self._frees[self.group_of(slot)].append(slot)

    def is_used(self, slot: int) -> bool:
        return self._used[slot]

    def check_invariants(self) -> None:
        every = [s for f in self._frees + self._snap_frees for s in f]
        free = set(every)
        assert len(free) == len(every), "slot free list holds duplicates"
        for g, f in enumerate(self._frees):
            assert all(self.group_of(s) == g and not self.is_snapshot(s) for s in f), \
                f"a slot of another group or kind is on group {g}'s free list"
        for g, f in enumerate(self._snap_frees):
            assert all(self.group_of(s) == g and self.is_snapshot(s) for s in f), \
                f"a slot of another group or kind is on group {g}'s snapshot free list"
        for s in range(self.num_slots):
            if s % self.per_group == 0:
                assert s not in free and self._used[s], f"scratch slot {s} is on the free list"
                continue
            assert self._used[s] != (s in free), f"slot {s}: used={self._used[s]} but {'in' if s in free else 'not in'} free list"
