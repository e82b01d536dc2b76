"""The engine's cache: the device cache's bookkeeping and the prefix cache.

- ``pages.PagePool``: refcounted MLA pages (per DP group and DCP rank).
- ``slots.SlotPool``: KDA state slots (a scratch slot per DP group, request and snapshot slots).
- ``planning.plan_capacity``: a device budget -> slots and pages (``CapacityPlan``).
- ``manager.CacheManager`` (the engine's ``cache_mgr``): the device cache plus who owns which
  slot and pages; ``device_ops``: its jitted copy programs.
- Prefix caching: ``prefix_keys`` (chained, tenant-salted unit keys), ``prefix_index`` (units ->
  pages and snapshots), ``prefix_cache.PrefixCache`` (hits, registration, eviction), ``host``
  (the host-DRAM tier), ``events`` (KV events for routers).
"""
from .manager import CacheManager
from .pages import PagePool
from .planning import NOMINAL_TOKENS_PER_SEQ, CapacityPlan, plan_capacity
from .slots import SCRATCH, SlotPool

__all__ = ["CacheManager", "CapacityPlan", "NOMINAL_TOKENS_PER_SEQ", "PagePool", "SCRATCH", "SlotPool", "plan_capacity"]
