"""Hybrid prefix caching (issue #6): reuse of MLA pages *and* KDA recurrent state.

The rule that makes it correct: a request may skip its first ``L`` tokens only if the cache
holds both the MLA rows of those ``L`` tokens (pages) and the KDA state after exactly ``L``
tokens (a snapshot). MLA rows can be kept for every token; KDA state only where it was copied
out — at **boundaries** (multiples of the prefix-match unit) chosen by the retention policies:

* **prompt end** — the last boundary strictly before the end of each prompt (strictly, so a
  resend of the same prompt hits it and still computes one token for its logits), and the
  last *page* boundary before it: the next turn often diverges a few tokens before the old
  prompt's end (a chat template re-renders the generation prompt or drops old reasoning;
  block-granular traces replace the partial last block), and that snapshot still matches;
* **output end** — while a request decodes, its state is copied into one private "tail"
  snapshot at every unit boundary; when it finishes, the last one is registered. The next
  turn of a conversation (prompt + this output + a new message) resumes from there;
* **interval** — every ``interval`` tokens (0 = off);
* **second hit** (Marconi) — a boundary seen before without a snapshot (where this prompt
  leaves a prefix an earlier request computed) is registered the second time it is computed.
  A request that arrives while another running request is still *computing* the shared part
  waits for it: the other request registers the branching point and this one resumes there
  (bursts of sub-agents on one prefix compute it once).

Snapshots are computed inside the step (``model.step``: the state after any token of a chunk,
exactly), so prefill chunks do not end on boundaries: :meth:`plan_snapshots` names, before a
step is launched, each boundary its chunks pass and the slot to write. A hit does not copy
the snapshot either: the request's first step *reads* its state from the snapshot slot and
writes its own slot. Within a step every state is read before any is written, and steps run
in program order, so a snapshot evicted and reused while a hit reads it is still read whole.
A hit that ends inside a page maps the whole pages read-only and gets a private copy of the
partly filled one. ``Request.num_computed`` is the one number both cache kinds agree on.

Tenants: keys are chained from a per-tenant root (``prefix.tenant_salt``), so two tenants never
share a page or a state.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

from .events import Event, KvEventLog, block_hash
from .host import HostEntry, HostTier
from .prefix_index import PrefixIndex
from .prefix_keys import PrefixChain, longest_match


def default_unit(page_size: int) -> int:
    """Prefix-match unit: half a page, at most 16 tokens, and a divisor of the page."""
    return math.gcd(page_size, max(1, min(16, page_size // 2)))


@dataclasses.dataclass
class Hit:
    tokens: int  # prefix tokens the request skips
    pages: list  # pages holding them (the last one partly, if tokens % page_size)
    snapshot: int | None  # snapshot slot with the KDA state after exactly ``tokens`` tokens
    group: int | None = 0
    rank0: int | None = 0
    host_key: bytes | None = None  # a host-tier hit (deeper than any device hit): reloaded at start


WAIT = "wait"  # lookup answer: another running request is computing this prefix; try next step


class PrefixCache:
    """Policy and registration on top of :class:`PrefixIndex` for one :class:`CacheManager`."""

    def __init__(self, cache_mgr, *, unit: int | None = None, interval: int = 0, second_hit: bool = True,
                 output_end: bool = True, max_bytes: int | None = None, seen_capacity: int = 1 << 16,
                 host_bytes: int = 0):
        unit = unit or default_unit(cache_mgr.page_size)
        if cache_mgr.page_size % unit:
            raise ValueError(f"prefix unit {unit} must divide the page size {cache_mgr.page_size}")
        if interval < 0 or interval % unit:
            raise ValueError(f"snapshot interval {interval} must be 0 (off) or a multiple of the prefix unit {unit}")
        if cache_mgr.capacity_plan.snapshot_slots < 1:
            raise ValueError("prefix caching needs snapshot slots (plan_capacity(snapshot_slots=...))")
        self.cache_mgr, self.unit, self.interval = cache_mgr, unit, interval
        self.second_hit, self.output_end = second_hit, output_end
        plan = cache_mgr.capacity_plan
        self.index = PrefixIndex(cache_mgr.pages, unit=unit, page_size=cache_mgr.page_size, max_bytes=max_bytes,
                                 bytes_per_page=plan.bytes_per_page, bytes_per_snapshot=plan.bytes_per_slot,
                                 free_snapshot=cache_mgr.slots.free_snapshot, on_event=self._on_index_event,
                                 on_evict=self._offload if host_bytes else None)
        self.host = HostTier(host_bytes, on_drop=cache_mgr.drop_host) if host_bytes else None
        self.events = KvEventLog()
        self._ctx_req = None  # the request being registered (its tokens name stored blocks)
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # keys of prefixes computed before
        self.seen_capacity = seen_capacity
        self._live: dict[bytes, object] = {}  # prompt keys of running requests -> request
        self._held: dict[str, list] = {}  # rid -> snapshot slots the request holds, not yet registered
        # counters (metrics)
        self.query_tokens = 0  # prompt tokens of admitted requests
        self.hit_tokens = 0  # tokens skipped by hits (KV and state alike: one number)
        self.kv_hit_tokens = 0  # of those, tokens in whole shared pages (not copied)
        self.num_hits = 0
        self.num_waits = 0
        self.num_cow = 0
        self.snapshots_skipped = 0  # boundaries a step had no snapshot entry left for

    # ------------------------------------------------------------------ keys
    def chain(self, req) -> list[bytes]:
        """``req``'s keys over its known tokens (prompt + output on the host)."""
        ch = getattr(req, "chain", None)
        if ch is None or ch.unit != self.unit:
            ch = req.chain = PrefixChain(self.unit, req.salt)
            req.chain_len = 0
        known = req.num_known
        if req.chain_len < known:  # only the tokens not keyed yet: O(new tokens) per call
            ch.extend(req.token_slice(req.chain_len, known))
            req.chain_len = known
        return ch.hashes

    def _on_index_event(self, kind: str, keys: list[bytes]) -> None:
        if kind == "removed":
            self.events.add(Event("removed", [block_hash(k) for k in keys]))
            return
        ents = self.index._entries
        first = ents[keys[0]]
        req = self._ctx_req
        u = self.unit
        self.events.add(Event("stored", [block_hash(k) for k in keys],
                              parent=block_hash(first[0]) if first[0] is not None else None,
                              token_ids=[req.token_slice(ents[k][2] * u, (ents[k][2] + 1) * u) if req else []
                                         for k in keys], block_size=u))

    def _offload(self, key: bytes, slot: int, units: int, pages: list[int]) -> None:
        """Index eviction hook: copy the prefix out to the host tier before its slot is reused."""
        if self.cache_mgr.device_cache is None:
            return
        tokens = units * self.unit
        if key in self.host:
            self.host.take(key)  # already there: only freshened
            return
        eid, nbytes = self.cache_mgr.offload_prefix(slot, pages, tokens)
        self.host.put(key, HostEntry(tokens, eid, nbytes))

    # ------------------------------------------------------------------ admission
    def lookup(self, req):
        """A :class:`Hit`, None (compute from scratch) or :data:`WAIT`."""
        hashes = self.chain(req)
        max_units = min(len(hashes), (req.num_tokens - 1) // self.unit)
        n, pages, snap = self.index.lookup(hashes, max_units)
        nh = self.host.deepest(hashes, n, max_units) if self.host is not None else 0
        c = longest_match(hashes[:max_units], self._live.__contains__)
        if c > max(n, nh):
            owner = self._live[hashes[c - 1]]
            end = c * self.unit
            if owner is not req and owner.status.value == "running" and owner.num_computed < end:
                owner.boundaries.add(end)  # it registers the branching point; this one resumes there
                self.num_waits += 1
                return WAIT
        if nh > n:  # the host tier holds a longer prefix: it wins
            return Hit(nh * self.unit, [], None, None, None, host_key=hashes[nh - 1])
        if n == 0:
            return None
        group, rank0 = self.cache_mgr.placement_of_page(pages[0], 0)
        return Hit(n * self.unit, pages, snap, group, rank0)

    def lookup_pages(self, req) -> Hit | None:
        """For a P/D decode: the longest cached prefix's whole pages, snapshot or not (the
        handoff brings the KDA state after the prompt), or None."""
        hashes = self.chain(req)
        n, pages = self.index.match(hashes[:min(len(hashes), (req.num_tokens - 1) // self.unit)])
        full = n * self.unit // self.cache_mgr.page_size
        if full == 0:
            return None
        group, rank0 = self.cache_mgr.placement_of_page(pages[0], 0)
        return Hit(full * self.cache_mgr.page_size, pages[:full], None, group, rank0)

    def start(self, req, hit: Hit | None) -> bool:
        """After ``mgr.admit``: map the hit (pages shared, tail page copied, snapshot copied into
        the request's slot) and set the request's boundaries. False if the copy-on-write page
        cannot be had (the caller releases the request; nothing else changed)."""
        hashes = self.chain(req)
        req.boundaries = set(getattr(req, "boundaries", ()) or ())
        req.read_slot = None
        n = 0
        if hit is not None and hit.host_key is not None:
            entry = self.host.take(hit.host_key)
            group = self.cache_mgr.group_of(req.rid)
            while not self.cache_mgr.ensure_tokens(req.rid, hit.tokens):
                if not self.reclaim(group):
                    return False
            self.cache_mgr.reload_prefix(req.rid, entry.eid, entry.tokens)
            req.num_computed = hit.tokens
            n = hit.tokens // self.unit
            self.host.reloaded += 1
            self.host.hit_tokens += hit.tokens
            self.num_hits += 1
            self.hit_tokens += hit.tokens
            # register it on the device again (the two tiers agree on the longest prefix)
            snap = self._alloc_snapshot(req)
            if snap is not None:
                self.cache_mgr.copy_slot(self.cache_mgr.slot_of(req.rid), snap)
                self._held.setdefault(req.rid, []).append((hit.tokens, snap, False))
        elif hit is not None:
            ps = self.cache_mgr.page_size
            full = hit.tokens // ps
            self.cache_mgr.map_shared(req.rid, hit.pages[:full])
            # the first step reads the snapshot and writes the own slot; until it is launched
            # the snapshot may not be evicted (a host reload could copy into its slot first).
            # A P/D decode's hit (``lookup_pages``) has whole pages and no snapshot: the
            # handoff brings the state after the prompt and only the later pages.
            if hit.snapshot is not None:
                req.read_slot = hit.snapshot
                self.index.pinned.add(hit.snapshot)
            if hit.tokens % ps:
                group = self.cache_mgr.group_of(req.rid)
                while not self.cache_mgr.copy_on_write(req.rid, hit.pages[full]):
                    if not self.reclaim(group):
                        return False
                self.num_cow += 1
            req.num_computed = hit.tokens
            n = hit.tokens // self.unit
            self.num_hits += 1
            self.hit_tokens += hit.tokens
            self.kv_hit_tokens += full * ps
        if req.cached_tokens is None:  # first admission (a re-admission after preemption is no new query)
            req.cached_tokens = n * self.unit
            self.query_tokens += req.num_known
        max_units = min(len(hashes), (req.num_tokens - 1) // self.unit)
        if self.second_hit:
            s = longest_match(hashes[:max_units], lambda h: h in self._seen or h in self.index)
            if s > n:
                req.boundaries.add(s * self.unit)
        for h in hashes[:max_units]:
            self._seen[h] = None
            self._seen.move_to_end(h)
            self._live[h] = req
        while len(self._seen) > self.seen_capacity:
            self._seen.popitem(last=False)
        return True

    # ------------------------------------------------------------------ boundaries
    def prompt_end(self, req) -> int:
        return (len(req.prompt) - 1) // self.unit * self.unit

    def prompt_page_end(self, req) -> int:
        ps = self.cache_mgr.page_size
        return (len(req.prompt) - 1) // ps * ps

    def is_boundary(self, req, pos: int) -> bool:
        if pos <= 0 or pos % self.unit:
            return False
        return (pos == self.prompt_end(req) or pos == self.prompt_page_end(req)
                or (self.interval and pos % self.interval == 0) or pos in req.boundaries)

    # ------------------------------------------------------------------ registration
    def plan_snapshots(self, rows, per_group: int) -> list[tuple[int, int, int]]:
        """The snapshots the step of ``rows`` computes: ``(row, tokens into the row's chunk,
        slot)`` for every boundary the chunk passes and, while a request decodes, its rolling
        tail at the last unit end the chunk reaches (output end). The step writes each state
        and conv window into its slot (``model.step``), so chunks need not end on boundaries.
        At most ``per_group`` per DP group: tails give way first, then the shallowest
        boundaries (``snapshots_skipped`` counts what is left out)."""
        want = []  # (priority, row, end, is_tail)
        u = self.unit
        for i, row in enumerate(rows):
            req = row.req
            if getattr(row, "assumed", 0):  # its start is known on the device only (async speculation)
                continue
            first = (row.start // u + 1) * u
            # a speculative row's drafts are not committed: no snapshot may cover them
            ends = range(first, row.start + row.num_tokens - len(getattr(row, "drafts", ())) + 1, u)
            bounds = [e for e in ends if self.is_boundary(req, e)]
            want += [(0, -e, i, e, False) for e in bounds]
            if self.output_end:
                tails = [e for e in ends if e > len(req.prompt) and e not in bounds]
                if tails:
                    want.append((1, -tails[-1], i, tails[-1], True))
        out, taken = [], {}
        for _, _, i, end, is_tail in sorted(want):
            req = rows[i].req
            g = self.cache_mgr.group_of(req.rid)
            if taken.get(g, 0) >= per_group:
                self.snapshots_skipped += 1
                continue
            held = self._held.setdefault(req.rid, [])
            if is_tail:  # the rolling tail snapshot: one per request, overwritten at each unit
                old = next((h for h in held if h[2]), None)
                if old is not None:
                    held.remove(old)
                    slot = old[1]
                else:
                    slot = self._alloc_snapshot(req)
            else:
                slot = self._alloc_snapshot(req)
            if slot is None:
                continue
            held.append((end, slot, is_tail))
            taken[g] = taken.get(g, 0) + 1
            out.append((i, end - rows[i].start, slot))
        return out

    def after_launch(self, rows) -> None:
        """Register the snapshots the step just launched computes whose keys are known; the
        hits' snapshots it read may be evicted again."""
        self.index.pinned.clear()
        for row in rows:
            self.register_ready(row.req)

    def _alloc_snapshot(self, req):
        group = self.cache_mgr.group_of(req.rid)
        slots = self.cache_mgr.slots
        s = slots.alloc_snapshot(group)
        while s is None and self.index.evict_one(where=lambda slot: slots.group_of(slot) == group):
            s = slots.alloc_snapshot(group)
        return s

    def register_ready(self, req, final: bool = False) -> None:
        """Register the held snapshots whose tokens are all known (the input token of a decode
        row may still be on the device); ``final`` (the request is leaving) registers the tail
        too and frees whatever cannot be registered."""
        held = self._held.get(req.rid)
        if not held:
            return
        hashes = self.chain(req)
        keep = []
        for end, slot, is_tail in held:
            units = end // self.unit
            if units > len(hashes) or (is_tail and not final):
                if final:
                    self.cache_mgr.slots.free_snapshot(slot)
                else:
                    keep.append((end, slot, is_tail))
                continue
            if self.cache_mgr.dp * self.cache_mgr.dcp > 1:
                # under DP/DCP a chain keeps one placement: a request that computed a cached
                # prefix elsewhere (its hit's DP group was full) cannot extend that chain
                have, cached = self.index.match(hashes[:units])
                if have and self.cache_mgr.placement_of_page(cached[0], 0) != self.cache_mgr.placement_of(req.rid):
                    self.cache_mgr.slots.free_snapshot(slot)
                    continue
            self._ctx_req = req
            try:
                ok = self.index.register(hashes[:units], self.cache_mgr.pages_of(req.rid), slot) == units
            finally:
                self._ctx_req = None
            if not ok:
                self.cache_mgr.slots.free_snapshot(slot)
        if keep:
            self._held[req.rid] = keep
        else:
            self._held.pop(req.rid, None)

    def release(self, req) -> None:
        """Before ``mgr.release``: register what the request holds, forget its live keys."""
        self.index.pinned.discard(req.read_slot)
        req.read_slot = None
        if req.rid in self.cache_mgr:
            self.register_ready(req, final=True)
        for end, slot, _ in self._held.pop(req.rid, []):
            self.cache_mgr.slots.free_snapshot(slot)
        ch = getattr(req, "chain", None)
        if ch is not None:
            for h in ch.hashes:
                if self._live.get(h) is req:
                    del self._live[h]

    def reclaim(self, group: int | None = None) -> bool:
        """Evict the least recently used snapshot (and the pages only it needed); False if none.
        ``group``: only one of that DP group (whose pages a request of that group needs)."""
        if group is None or self.cache_mgr.dp == 1:
            return self.index.evict_one()
        slots = self.cache_mgr.slots
        return self.index.evict_one(where=lambda slot: slots.group_of(slot) == group)

    # ------------------------------------------------------------------ introspection
    def page_refs(self) -> dict[int, int]:
        return self.index.page_refs()

    def bytes_held(self) -> int:
        """Device bytes of cached pages + snapshots (registered, and held by requests)."""
        return self.index.bytes_held + self.held_snapshots() * self.cache_mgr.capacity_plan.bytes_per_slot

    def held_snapshots(self) -> int:
        return sum(len(v) for v in self._held.values())

    def flush(self) -> int:
        """Drop every cached prefix on both tiers; returns the device snapshots dropped."""
        n = self.index.num_snapshots
        self.index.evict_all()
        if self.host is not None:
            self.host.clear()
        return n

    def check_invariants(self) -> None:
        self.index.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        held = [s for v in self._held.values() for _, s, _ in v]
        slots = held + self.index.snapshot_slots()
        assert len(set(slots)) == len(slots), "a snapshot slot is both held and registered, or held twice"
        assert self.cache_mgr.slots.num_snapshots_used == len(slots), \
            f"{self.cache_mgr.slots.num_snapshots_used} snapshot slots in use, {len(slots)} accounted for"
        self.cache_mgr.check_invariants(extra_page_refs=self.index.page_refs())

    def stats(self) -> dict:
        return {"prefix_unit": self.unit, "prefix_interval": self.interval,
                "prefix_query_tokens": self.query_tokens, "prefix_hit_tokens": self.hit_tokens,
                "prefix_kv_hit_tokens": self.kv_hit_tokens, "prefix_state_hit_tokens": self.hit_tokens,
                "prefix_hits": self.num_hits, "snapshots_skipped": self.snapshots_skipped, "prefix_waits": self.num_waits, "prefix_cow_pages": self.num_cow,
                "snapshots_registered": self.index.snapshots_registered,
                "snapshots_evicted": self.index.snapshots_evicted, "snapshots_held": self.index.num_snapshots,
                "prefix_pages_held": self.index.num_pages,
                "prefix_device_bytes": self.bytes_held(),
                "snapshot_bytes": (self.index.num_snapshots + self.held_snapshots()) * self.cache_mgr.capacity_plan.bytes_per_slot,
                "prefix_host_bytes": self.host.bytes_held if self.host else 0,
                "prefix_host_entries": len(self.host) if self.host else 0,
                "prefix_host_offloads": self.host.offloaded if self.host else 0,
                "prefix_host_reloads": self.host.reloaded if self.host else 0,
                "prefix_host_hit_tokens": self.host.hit_tokens if self.host else 0}
