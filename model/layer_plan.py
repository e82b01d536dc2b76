"""How the decoder stack is compiled: a few unrolled layers around one ``lax.scan``.

K3 repeats one pattern — three KDA layers and an MLA layer, each with a MoE — 22 times; only
the first layers (layer 0 has a dense MLP) and the last (a second consecutive MLA layer)
break it. The step therefore runs ``head`` layers unrolled, then ``groups`` repetitions of a
``period``-layer group as a scan over parameters stacked ``[groups, ...]``, then ``tail``
layers unrolled. The traced graph holds ``len(head) + period + len(tail)`` layer bodies
whatever the depth: K3's 93 layers trace 9 bodies, a 49-layer demo variant as many as the
13-layer demo.

The plan is chosen from the config alone (layers differ by attention kind and by dense MLP
vs MoE): the period and offset that leave the fewest layer bodies to trace, preferring the
shorter period and then the earlier offset. A stack with no pattern repeated twice is all
``head``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    num_layers: int
    head: tuple[int, ...]  # unrolled before the scan
    start: int  # first scanned layer
    period: int  # layers per scanned group
    groups: int  # scanned groups (0: no scan)
    tail: tuple[int, ...]  # unrolled after the scan

    @property
    def scanned(self) -> range:
        return range(self.start, self.start + self.period * self.groups)

    @property
    def traced_bodies(self) -> int:
        return len(self.head) + (self.period if self.groups else 0) + len(self.tail)

    def locate(self, layer: int) -> tuple[str, int, int | None]:
        """``("head" | "blocks" | "tail", index, group)``: where layer ``layer`` lives;
        ``group`` is its row in the stacked parameters (``None`` when unrolled)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if layer in self.scanned:
            g, i = divmod(layer - self.start, self.period)
            return "blocks", i, g
        if layer < self.start or not self.groups:
            return "head", self.head.index(layer), None
        return "tail", self.tail.index(layer), None

    def layer_of(self, i: int, g: int) -> int:
        return self.start + g * self.period + i


def _signature(cfg, layer: int) -> tuple:
    return cfg.layer_types[layer], cfg.is_moe_layer(layer)


def plan_layers(cfg, max_period: int = 8) -> LayerPlan:
    L = cfg.num_hidden_layers
    sig = [_signature(cfg, l) for l in range(L)]
    best = None  # (bodies, period, start, groups)
    for p in range(1, min(max_period, L // 2) + 1):
        for s in range(0, L - 2 * p + 1):
            pattern = sig[s : s + p]
            g = 1
            while s + (g + 1) * p <= L and sig[s + g * p : s + (g + 1) * p] == pattern:
                g += 1
            if g < 2:
                continue
            key = (L - g * p + p, p, s, g)
            if best is None or key < best:
                best = key
    if best is None:
        return LayerPlan(L, tuple(range(L)), L, 1, 0, ())
    _, p, s, g = best
    return LayerPlan(L, tuple(range(s)), s, p, g, tuple(range(s + g * p, L)))
