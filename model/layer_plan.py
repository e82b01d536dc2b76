"""How the decoder stack is compiled: one ``lax.scan`` over every layer, a branch per kind.

K3's 93 layers are of three kinds only: KDA with a dense MLP (layer 0), KDA with a MoE, and
MLA with a MoE. The parameters of each kind are stacked ``[layers of that kind, ...]``; the
step scans over all layers in order and each iteration runs its layer's kind (``lax.switch``)
on its row of that kind's stack. The traced graph holds one layer body per kind whatever the
depth: K3 and the demo trace 3 bodies, a 49-layer demo variant as many as the 13-layer one.

The kind of a layer is its attention kind and whether its FFN is a MoE; kinds are numbered
in order of first appearance.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    num_layers: int
    kinds: tuple[tuple[str, bool], ...]  # (attention kind, is MoE), by first appearance
    kind_of: tuple[int, ...]  # per layer: its kind
    row_of: tuple[int, ...]  # per layer: its row in the kind's stack

    @property
    def traced_bodies(self) -> int:
        return len(self.kinds)

    def locate(self, layer: int) -> tuple[int, int]:
        """``(kind, row)`` of layer ``layer``: ``blocks[kind]`` holds it at ``row``."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.kind_of[layer], self.row_of[layer]

    def layers_of(self, kind: int) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if self.kind_of[l] == kind)


def plan_layers(cfg) -> LayerPlan:
    kinds: list = []
    kind_of, row_of, counts = [], [], []
    for l in range(cfg.num_hidden_layers):
        sig = (cfg.layer_types[l], bool(cfg.is_moe_layer(l)))
        if sig not in kinds:
            kinds.append(sig)
            counts.append(0)
        k = kinds.index(sig)
        kind_of.append(k)
        row_of.append(counts[k])
        counts[k] += 1
    return LayerPlan(cfg.num_hidden_layers, tuple(kinds), tuple(kind_of), tuple(row_of))
