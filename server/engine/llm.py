"""The offline Python API: ``LLM(path).generate(prompts, params)`` and ``LLM.stream``."""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from ...checkpoints import load_pretrained
from .engine import Engine
from .request import EngineError, RequestOutput
from .sampling_params import SamplingParams, sample_params


def recipe_placement(model_path, recipe, devices=None):
    """The ``placement`` that loads ``model_path`` straight into the shards of ``recipe``'s mesh
    over ``devices`` (default: all), or ``None`` without a recipe. The recipe is checked against
    the checkpoint's config.json before any tensor is read; the mesh is the one ``Engine(...,
    recipe=recipe, devices=devices)`` builds, so the engine keeps the parameters where they are."""
    if recipe is None:
        return None
    import jax

    from ...checkpoints.config_of import checkpoint_config
    from ...model import K3Config
    from ...sharding.mesh import build_mesh, placement_for
    from ...sharding.recipe import Recipe

    cfg = K3Config.from_dict(checkpoint_config(model_path))
    devs = list(jax.devices() if devices is None else devices)
    return placement_for(build_mesh(Recipe.parse(recipe).validate(cfg, num_devices=len(devs)), devs))


class LLM:
    """Offline generation over one engine. ``generate`` and ``stream`` share it: outputs of
    one caller's requests that arrive while another steps the engine are kept for their
    owner, never dropped. A failed step raises ``EngineError`` (the engine cannot go on)."""

    def __init__(self, model_path, dtype: str = "float32", *, dequantize_experts: bool = False,
                 kernels: str | None = None, **engine_kwargs):
        placement = recipe_placement(model_path, engine_kwargs.get("recipe"), engine_kwargs.get("devices"))
        self.model = load_pretrained(model_path, dtype=dtype, dequantize_experts=dequantize_experts,
                                     placement=placement, kernels=kernels)
        if "tokenizer" not in engine_kwargs and "detokenizer" not in engine_kwargs:
            # stop strings and constrained decoding need the checkpoint's tokenizer
            from ..text.tokenizer import load_tokenizer

            engine_kwargs["tokenizer"] = load_tokenizer(model_path)
        self.engine = Engine(self.model, **engine_kwargs)
        self._mine: dict[str, list[RequestOutput]] = {}  # rid -> outputs not yet taken by its caller

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in prompt order.
        ``prompts``: a list of prompts (each a sequence of ids or an integer numpy array), or
        one prompt (a flat sequence of ids, or a 1-D integer array). A prompt whose params ask
        for ``n > 1`` samples gets a list of ``n`` outputs (sample ``i`` seeded ``seed + i``);
        its prompt is computed once when prefix caching is on (the samples wait for it)."""
        if isinstance(prompts, np.ndarray):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        elif len(prompts) and isinstance(prompts[0], (int, np.integer)):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("need one SamplingParams per prompt (or a single one)")
        groups = []  # per prompt: its request ids (n of them for n samples)
        for p, sp in zip(prompts, plist):
            n = sp.n if sp is not None else 1
            if n > 1:
                self.engine.validate(p, sp)  # the limit on n, before any sample is queued
            groups.append([self._add(p, sample_params(sp, i) if n > 1 else sp) for i in range(n)])
        rids = [r for g in groups for r in g]
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(rids):
                for rid in rids:
                    for out in self._take(rid):
                        if out.finished:
                            done[rid] = out
                if len(done) < len(rids):
                    self._step()
        finally:
            for rid in rids:
                self._mine.pop(rid, None)
                if rid not in done and self.engine.broken is None:
                    self.engine.abort(rid)
        return [done[g[0]] if len(g) == 1 and (plist[i] is None or plist[i].n == 1) else [done[r] for r in g]
                for i, g in enumerate(groups)]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one delta per step that produced tokens for this prompt, the last finished."""
        if params is not None and params.n > 1:
            raise ValueError("stream() runs one sample (n=1); generate() takes n > 1")
        rid = self._add(prompt, params)
        try:
            while True:
                for out in self._take(rid):
                    yield out
                    if out.finished:
                        return
                self._step()
        finally:
            self._mine.pop(rid, None)
            if self.engine.broken is None:
                self.engine.abort(rid)

    def _add(self, prompt, params) -> str:
        rid = self.engine.add_request(prompt, params)
        self._mine[rid] = []
        return rid

    def _take(self, rid: str) -> list[RequestOutput]:
        outs, self._mine[rid] = self._mine.get(rid, []), []
        return outs

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"engine step failed: {e!r}; this LLM cannot generate any more "
                              "(its engine state is half-updated)") from e
        for out in outs:
            if out.rid in self._mine:
                self._mine[out.rid].append(out)
