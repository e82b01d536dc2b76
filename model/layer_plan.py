"""How the decoder stack is compiled: one ``lax.scan`` over every layer, a branch per sublayer type.

A layer is an attention sublayer and an FFN sublayer. K3's 93 layers use two attention types
(KDA, MLA) and two FFN types (a dense MLP at layer 0, a MoE elsewhere). The parameters of each
type are stacked ``[layers of that type, ...]``: ``attn[a]`` holds every attention sublayer of
type ``a`` (its input norm, AttnRes weights and attention), ``ffn[f]`` every FFN sublayer of
type ``f`` (its post-attention norm, AttnRes weights and MLP or MoE). The step scans over all
layers in order; each iteration runs its attention type on its row of that stack and its FFN
type on its row of the other (``lax.switch``). The traced graph holds one body per type,
whatever the depth and however the types combine: K3 and the demo trace 4 (KDA, MLA, MLP, MoE),
a 49-layer demo as many as the 13-layer one, and the MoE is compiled once however many
attention types precede it.

Types are numbered in order of first appearance.
"""
from __future__ import annotations

import dataclasses

ATTN_PART = ("input_layernorm", "self_attn", "self_attention_res")  # a layer's attention sublayer
FFN_PART = ("post_attention_layernorm", "mlp", "block_sparse_moe", "mlp_res")  # its FFN sublayer


def part_of(name: str) -> str:
    """``"attn"`` or ``"ffn"``: which sublayer a layer parameter (``self_attn.A_log``, or as a
    checkpoint names it after ``model.layers.{l}.``) is in."""
    head = name.split(".", 1)[0]
    for part, names in (("attn", ATTN_PART), ("ffn", FFN_PART)):
        # a module name, or a checkpoint's flat spelling (``self_attention_res_proj.weight``)
        if any(head == n or head.startswith(n + "_") for n in names):
            return part
    raise KeyError(f"{name!r} is not a layer parameter")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    num_layers: int
    attn_types: tuple[str, ...]  # attention kinds ("kda", "mla"), by first appearance
    ffn_types: tuple[bool, ...]  # is MoE, by first appearance
    attn_of: tuple[int, ...]  # per layer: its attention type
    attn_row: tuple[int, ...]  # per layer: its row in that type's stack
    ffn_of: tuple[int, ...]  # per layer: its FFN type
    ffn_row: tuple[int, ...]  # per layer: its row in that type's stack

    @property
    def traced_bodies(self) -> int:
        return len(self.attn_types) + len(self.ffn_types)

    def locate(self, layer: int, part: str) -> tuple[int, int]:
        """``(type, row)`` of layer ``layer``'s ``part`` ("attn" or "ffn"): ``attn[type]`` or
        ``ffn[type]`` holds it at ``row``."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if part == "attn":
            return self.attn_of[layer], self.attn_row[layer]
        if part == "ffn":
            return self.ffn_of[layer], self.ffn_row[layer]
        raise ValueError(f"part must be 'attn' or 'ffn', got {part!r}")

    def layers_of(self, part: str, typ: int) -> tuple[int, ...]:
        of = self.attn_of if part == "attn" else self.ffn_of
        return tuple(l for l in range(self.num_layers) if of[l] == typ)


def _number(sigs: list) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
    """Types by first appearance, each item's type and its row among the items of that type."""
    types: list = []
    of, row, counts = [], [], []
    for s in sigs:
        if s not in types:
            types.append(s)
            counts.append(0)
        t = types.index(s)
        of.append(t)
        row.append(counts[t])
        counts[t] += 1
    return tuple(types), tuple(of), tuple(row)


def plan_layers(cfg) -> LayerPlan:
    L = cfg.num_hidden_layers
    attn_types, attn_of, attn_row = _number([cfg.layer_types[l] for l in range(L)])
    ffn_types, ffn_of, ffn_row = _number([bool(cfg.is_moe_layer(l)) for l in range(L)])
    return LayerPlan(L, attn_types, ffn_types, attn_of, attn_row, ffn_of, ffn_row)
