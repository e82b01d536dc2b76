"""What a worker tells a router about itself before its weights are loaded.

A router registers a worker once: smg reads ``GetModelInfo`` and ``GetServerInfo`` into the
worker's labels (served model name, context length, tokenizer path, P/D role, limits) when it
first reaches it, and never asks again. A router started beside its workers reaches them while
they load, so a server that answered UNAVAILABLE then was registered as model ``unknown`` and
never routed to (issue #32). Everything such a router reads is known before the load: the
model from the checkpoint's config, the limits from the serve flags. :class:`EnginePlan` is
that shape, planned from the flags as ``Engine`` will derive it and read back from the engine
once it is up; the smg tests compare the two answers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnginePlan:
    """The engine's limits and layout, as a router reads them."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_size: int
    page_size: int
    dtype: str
    recipe: Any = None  # sharding.recipe.Recipe, or None: one device, no recipe
    num_processes: int = 1
    speculative_algorithm: str | None = None  # speculative decoding's drafter, None: off
    speculative_num_draft_tokens: int = 0

    @classmethod
    def planned(cls, *, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                chunk_size: int | None, page_size: int, dtype="float32", recipe=None,
                num_processes: int = 1, speculative: str | None = None,
                num_speculative_tokens: int = 0) -> "EnginePlan":
        """The plan of an ``Engine`` built with these arguments (``engine_args.build_engine``)."""
        from ...model.pretrained import resolve_dtype
        from ...sharding.recipe import Recipe

        return cls(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens,
                   chunk_size=min(chunk_size or max_num_batched_tokens, max_num_batched_tokens),
                   page_size=page_size, dtype=str(resolve_dtype(dtype)),
                   recipe=Recipe.parse(recipe) if recipe is not None else None, num_processes=num_processes,
                   speculative_algorithm=speculative,
                   speculative_num_draft_tokens=num_speculative_tokens if speculative else 0)

    @classmethod
    def from_serve_args(cls, args, num_processes: int = 1) -> "EnginePlan":
        return cls.planned(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size,
                           page_size=args.page_size, dtype=args.dtype, recipe=args.recipe,
                           num_processes=num_processes, speculative=getattr(args, "speculative", None),
                           num_speculative_tokens=getattr(args, "num_speculative_tokens", 0))

    @classmethod
    def of_engine(cls, eng) -> "EnginePlan":
        """What a built engine really has (the answer after the load)."""
        s = eng.scheduler
        return cls(max_model_len=eng.max_model_len, max_num_seqs=s.max_num_seqs,
                   max_num_batched_tokens=s.max_num_batched_tokens, chunk_size=s.chunk_size,
                   page_size=eng.capacity_plan.page_size, dtype=str(eng.model.dtype), recipe=eng.recipe,
                   num_processes=eng.dispatch.num_processes, speculative_algorithm=getattr(eng, "spec_method", None),
                   speculative_num_draft_tokens=getattr(eng, "spec_k", 0))

    def server_args(self) -> dict:
        """``GetServerInfo.server_args``' limits and parallel sizes (SGLang's names)."""
        r = self.recipe
        sizes = ({"tp_size": 1, "dp_size": 1, "ep_size": 1, "dcp_size": 1} if r is None else
                 {"tp_size": r.attn_tp, "dp_size": r.dp, "ep_size": r.ep, "moe_tp_size": r.tp, "dcp_size": r.dcp,
                  "sp_size": r.sp})
        return {"max_running_requests": self.max_num_seqs, "max_num_seqs": self.max_num_seqs,
                "max_prefill_tokens": self.max_num_batched_tokens, "chunked_prefill_size": self.chunk_size,
                "page_size": self.page_size, "context_length": self.max_model_len, "pp_size": 1, **sizes,
                "nnodes": self.num_processes, "num_processes": self.num_processes, "dtype": self.dtype,
                "recipe": str(r) if r is not None else "single",
                "speculative_algorithm": self.speculative_algorithm,
                "speculative_num_draft_tokens": self.speculative_num_draft_tokens}


def planned_disaggregation(role: str, bootstrap_port: int | None) -> dict:
    """``server_args``' P/D fields of a server that will take ``role`` once loaded."""
    if role == "prefill":
        return {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": bootstrap_port,
                "disaggregation_transfer_backend": "jax-transfer"}
    if role == "decode":
        return {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "jax-transfer"}
    return {"disaggregation_mode": "null"}


def checkpoint_config(model_dir: Path | None) -> dict:
    """The checkpoint's config.json as a dict (a pre-sharded checkpoint: its manifest's copy);
    {} when there is none."""
    if model_dir is None:
        return {}
    from ...checkpoints.preshard_format import is_preshard, read_manifest

    if is_preshard(model_dir):
        return dict(read_manifest(model_dir)["config"])
    f = Path(model_dir) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else {}
