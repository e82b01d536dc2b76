"""What a prefill and a decode engine must agree on before raw arrays move between them:
the cache's shapes and dtypes (a fingerprint of the model config) and the page size; recipes
and DCP sizes may differ (``engine/cache/deal.py``). Both sides compute the pieces of one
handoff from the prompt length and the decode's destination alone, so the decode checks the
prefill's announcement against its own expectation before it pulls a byte."""
from __future__ import annotations

import hashlib
import json
import zlib

import numpy as np

from ...intmath import cdiv, next_pow2
from ...model.cache import cache_shapes, conv_window_shape
from ..engine.cache.deal import Destination
from . import bootstrap_pb2 as pb


def cache_layout(engine) -> "pb.CacheLayout":
    cfg, plan = engine.model.config, engine.capacity_plan
    shapes = cache_shapes(cfg, 1, 1, plan.page_size, engine.model.dtype)
    desc = {k: [list(s), str(np.dtype(d))] for k, (s, d) in sorted(shapes.items())}
    desc.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, layers=cfg.num_hidden_layers)
    if getattr(cfg, "draft_kv_layers", 0):  # a DSpark pair: the draft's context rows ship with the pages
        desc["draft_kv_layers"] = cfg.draft_kv_layers
    fp = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]
    return pb.CacheLayout(model_fingerprint=fp, page_size=plan.page_size, kv_dtype=str(np.dtype(engine.model.dtype)),
                          dcp_size=plan.dcp)


def incompatibility(mine: "pb.CacheLayout", theirs: "pb.CacheLayout") -> str | None:
    """Why a handoff between the two layouts cannot work, or None."""
    if mine.model_fingerprint != theirs.model_fingerprint:
        return ("the two servers hold different models (cache fingerprints differ; a DSpark draft's "
                "context rows are part of the cache, so both sides need the same --speculative dspark "
                "--draft-model or neither)")
    if mine.page_size != theirs.page_size:
        return f"page sizes differ ({theirs.page_size} there, {mine.page_size} here)"
    if mine.kv_dtype != theirs.kv_dtype:
        return f"cache dtypes differ ({theirs.kv_dtype} there, {mine.kv_dtype} here)"
    return None  # DCP sizes and recipes may differ: deal.py cuts for the decode's layout


def export_specs(engine, prompt_len: int) -> list[tuple[tuple[int, ...], str]]:
    """``(shape, dtype)`` of the export of a ``prompt_len``-token handoff, in order: KDA state,
    conv windows (one slot of each), MLA rows of the prompt's pages padded to a power of two
    (``CacheManager.export_request``)."""
    cfg, ps = engine.model.config, engine.capacity_plan.page_size
    shapes = cache_shapes(cfg, 1, 1, ps, engine.model.dtype)
    (st, st_d), (cv, cv_d), (kv, kv_d) = (shapes[k] for k in ("kda_state", "kda_conv", "mla_kv"))
    pages = next_pow2(cdiv(prompt_len, ps))
    return [((st[0],) + tuple(st[2:]), str(np.dtype(st_d))), (conv_window_shape(cfg, st[0]), str(np.dtype(cv_d))),
            ((kv[0], pages) + tuple(kv[2:]), str(np.dtype(kv_d)))]


def piece_specs(engine, prompt_len: int, dest: Destination) -> list[tuple[tuple[int, ...], str]]:
    """``(shape, dtype)`` of the pieces ``dest`` asks for, in order (``cache/deal.py``)."""
    (st, st_d), (cv, cv_d), (kv, kv_d) = export_specs(engine, prompt_len)
    shapes = dest.piece_shapes(st, cv, kv)
    dtypes = [cv_d] + [st_d] * len(dest.head_starts) + [kv_d] * len(dest.sent_ranks)
    return list(zip(shapes, dtypes))


def destination_pb(dest: Destination) -> "pb.Destination":
    return pb.Destination(first_page=dest.first_page, head_count=dest.head_count, head_starts=list(dest.head_starts),
                          page_lists=[pb.PageList(pages=list(p)) for p in dest.page_lists], pulls=list(dest.pulls))


def destination_of(msg: "pb.Destination") -> Destination:
    return Destination(first_page=msg.first_page, head_count=msg.head_count, head_starts=tuple(msg.head_starts),
                       page_lists=tuple(tuple(p.pages) for p in msg.page_lists), pulls=tuple(msg.pulls))


def side_processes(engine) -> int:
    """Processes the engine's devices belong to (a multi-host side: more than one)."""
    return len({d.process_index for d in engine_devices(engine)})


def engine_devices(engine) -> list:
    """The devices the engine's cache lives on, in id order (where pieces are cut and staged)."""
    return sorted(engine.cache_mgr.device_cache.mla_kv.sharding.device_set, key=lambda d: d.id)


def prompt_crc32(ids) -> int:
    return zlib.crc32(np.asarray(ids, "<u4").tobytes())
