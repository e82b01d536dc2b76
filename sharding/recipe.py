"""Parallelism recipes: how a K3 deployment splits over a device mesh, as plain data.

A recipe names the size of each parallel axis (the meaning follows the TPU v7 deployment
k3serve targets; see the README's "Sharding recipes"):

* ``ep`` × ``tp`` = the number of devices. The MoE splits experts into ``ep`` groups and
  tensor-splits each expert's matmuls ``tp`` ways inside a group.
* ``dp``: attention data-parallel groups. Each group of ``devices / dp`` ranks holds a full
  copy of the attention weights (tensor-parallel over the group's ranks: KDA heads and MLA
  query heads split) and serves its own share of requests with its own cache. The MoE still
  spans all devices.
* ``dcp``: decode context parallelism inside an attention group: every sequence's MLA pages
  are dealt round-robin over ``dcp`` ranks (page k on rank k mod dcp); each rank attends over
  its local pages and the partial results are merged exactly (online softmax).
* ``sp``: sequence parallelism for the token-wise ops between layers (AttnRes, norms) on
  steps with at least ``sp_min_rows`` rows (default 1,024: prefill and long mixed steps, not
  decode).

``Recipe.parse("ep=8,tp=4,dcp=32,sp=4")`` or a preset name; unspecified sizes are 1.
``Recipe.validate(cfg, num_devices)`` raises :class:`RecipeError` with a message that says
what does not divide what (or what does not fit the mesh layout); a recipe it accepts runs.
Only ``model/config`` is imported (the sharding floor).
"""
from __future__ import annotations

import dataclasses
import re

_AXES = ("ep", "tp", "dp", "dcp", "sp")
SP_MIN_ROWS = 1024


class RecipeError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Recipe:
    ep: int = 1
    tp: int = 1
    dp: int = 1
    dcp: int = 1
    sp: int = 1
    # sequence parallelism only for steps with at least this many rows: below it the pair of
    # collectives SP makes of each reduction costs latency and saves nothing (docs/sharding.md)
    sp_min_rows: int = SP_MIN_ROWS
    name: str = ""

    def __post_init__(self):
        for a in _AXES + ("sp_min_rows",):
            v = getattr(self, a)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RecipeError(f"{a} must be a positive integer, got {v!r}")
        if self.devices % self.dp:
            raise RecipeError(f"dp={self.dp} must divide the {self.devices} devices (ep × tp)")
        if self.attn_group % self.dcp:
            raise RecipeError(f"dcp={self.dcp} must divide the attention group of {self.attn_group} ranks "
                              f"(devices / dp = {self.devices} / {self.dp})")
        if self.attn_group % self.sp:
            raise RecipeError(f"sp={self.sp} must divide the attention group of {self.attn_group} ranks")

    # ------------------------------------------------------------------ derived sizes
    @property
    def devices(self) -> int:
        """Mesh size: the MoE spans every device as ep × tp."""
        return self.ep * self.tp

    @property
    def attn_group(self) -> int:
        """Ranks of one attention data-parallel group (its attention tensor-parallel degree)."""
        return self.devices // self.dp

    @property
    def attn_tp(self) -> int:
        return self.attn_group

    def __str__(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in _AXES if getattr(self, a) != 1 or a in ("ep", "tp")]
        if self.sp > 1 and self.sp_min_rows != SP_MIN_ROWS:
            parts.append(f"sp_min_rows={self.sp_min_rows}")
        return ",".join(parts)

    def describe(self) -> dict:
        return {"recipe": self.name or str(self), "spec": str(self), "devices": self.devices, "ep": self.ep,
                "tp": self.tp, "dp": self.dp, "dcp": self.dcp, "sp": self.sp, "attn_tp": self.attn_tp,
                "sp_min_rows": self.sp_min_rows}

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, text: "str | Recipe | None") -> "Recipe":
        """A preset name (see :data:`PRESETS`) or ``"ep=8,tp=4,dp=2,dcp=16,sp=4"``."""
        if isinstance(text, Recipe):
            return text
        if text is None or not str(text).strip():
            return PRESETS["single"]
        text = str(text).strip()
        if text in PRESETS:
            return PRESETS[text]
        sizes: dict[str, int] = {}
        for part in text.split(","):
            m = re.fullmatch(r"\s*([a-z_]+)\s*=\s*(\d+)\s*", part)
            if not m:
                raise RecipeError(f"cannot parse {part.strip()!r} in recipe {text!r}: expected name=int "
                                  f"(names: {', '.join(_AXES)}, sp_min_rows) or a preset "
                                  f"({', '.join(PRESETS)})")
            k, v = m.group(1), int(m.group(2))
            if k not in _AXES + ("sp_min_rows",):
                raise RecipeError(f"unknown axis {k!r} in recipe {text!r} (known: {', '.join(_AXES)}, sp_min_rows)")
            if k in sizes:
                raise RecipeError(f"{k} given twice in recipe {text!r}")
            sizes[k] = v
        return cls(**sizes)

    # ------------------------------------------------------------------ checks against a model
    def validate(self, cfg=None, num_devices: int | None = None) -> "Recipe":
        """Raise RecipeError if this recipe cannot run ``cfg`` on ``num_devices`` devices."""
        if num_devices is not None and num_devices != self.devices:
            raise RecipeError(f"recipe {self} needs ep × tp = {self.devices} devices, the mesh has {num_devices}")
        # the mesh layout (sharding.mesh): ("dp", "ep", "tp") of shape (dp, ep / dp, tp); DCP and
        # SP run over whole axes of one attention group
        if self.ep % self.dp:
            raise RecipeError(f"dp={self.dp} must divide ep={self.ep}: the attention DP groups are slices of the "
                              f"expert groups in this mesh layout (recipe {self})")
        for what, size in (("dcp", self.dcp), ("sp", self.sp)):
            if size not in (1, self.tp, self.ep // self.dp, self.attn_group):
                raise RecipeError(f"{what}={size} must be 1, tp={self.tp}, ep/dp={self.ep // self.dp} or the "
                                  f"attention group {self.attn_group} in this mesh layout (recipe {self})")
        if cfg is None:
            return self
        g = self.attn_group
        checks = [
            (cfg.num_experts, self.ep, "routed experts", "ep"),
            (cfg.moe_intermediate_size, self.tp, "expert intermediate size", "MoE tp"),
        ]
        if cfg.kda_layers:
            checks.append((cfg.kda_num_heads, g, "KDA heads", "the attention tensor-parallel degree (devices / dp)"))
        if cfg.mla_layers:
            checks.append((cfg.mla_num_heads, g, "MLA query heads", "the attention tensor-parallel degree (devices / dp)"))
        for have, by, what, axis in checks:
            if have % by:
                raise RecipeError(f"{what} ({have}) are not divisible by {axis} = {by} in recipe {self}")
        if self.dcp > 1 and not cfg.mla_layers:
            raise RecipeError(f"dcp={self.dcp} needs MLA layers (this model has none)")
        return self


PRESETS: dict[str, Recipe] = {
    "single": Recipe(name="single"),
    # TPU v7, 32 devices (16 chips): decode at low/mid concurrency
    "v7-32-decode": Recipe(ep=8, tp=4, dcp=32, sp=4, name="v7-32-decode"),
    # TPU v7, 32 devices (16 chips): decode at >= 48 concurrent requests (attention DP2 x DCP16)
    "v7-32-decode-dp2": Recipe(ep=8, tp=4, dp=2, dcp=16, sp=4, name="v7-32-decode-dp2"),
    # TPU v7, 32 devices (16 chips): prefill slice
    "v7-32-prefill": Recipe(ep=32, tp=1, name="v7-32-prefill"),
    # TPU v7, 16 devices (8 chips)
    "v7-16-decode": Recipe(ep=4, tp=4, dcp=16, sp=4, name="v7-16-decode"),
    # small ones for tests on CPU virtual devices
    "test-4": Recipe(ep=2, tp=2, dcp=4, sp=2, sp_min_rows=2, name="test-4"),
    "test-8-dp2": Recipe(ep=4, tp=2, dp=2, dcp=4, sp=2, sp_min_rows=2, name="test-8-dp2"),
}
