"""Cache management: which request owns which KDA slot and MLA pages, and how big the cache is.

``pages.PagePool`` (refcounted MLA pages), ``slots.SlotPool`` (KDA slots, slot 0 scratch),
``manager.plan_capacity`` (budget -> sizes) and ``manager.CacheManager`` (device cache +
per-request bookkeeping). Why and layouts: see each module's docstring.
"""
from .manager import NOMINAL_TOKENS_PER_SEQ, CacheManager, CachePlan, plan_capacity
from .pages import PagePool
from .slots import SCRATCH, SlotPool

__all__ = ["CacheManager", "CachePlan", "NOMINAL_TOKENS_PER_SEQ", "PagePool", "SCRATCH", "SlotPool", "plan_capacity"]
