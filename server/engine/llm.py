"""The offline Python API: ``LLM(path).generate(prompts, params)`` and ``LLM.stream``."""
from __future__ import annotations

from typing import Iterator, Sequence

from ...model import load_pretrained
from .engine import Engine
from .request import RequestOutput
from .sampling_params import SamplingParams


def recipe_placement(model_path, recipe, devices=None):
    """The ``placement`` that loads ``model_path`` straight into the shards of ``recipe``'s mesh
    over ``devices`` (default: all), or ``None`` without a recipe. The recipe is checked against
    the checkpoint's config.json before any tensor is read; the mesh is the one ``Engine(...,
    recipe=recipe, devices=devices)`` builds, so the engine keeps the parameters where they are."""
    if recipe is None:
        return None
    import jax

    from ...checkpoints.safetensors_io import open_checkpoint
    from ...model import K3Config
    from ...sharding.mesh import build_mesh, placement_for
    from ...sharding.recipe import Recipe

    with open_checkpoint(model_path) as ckpt:
        cfg = K3Config.from_dict(ckpt.config)
    devs = list(jax.devices() if devices is None else devices)
    return placement_for(build_mesh(Recipe.parse(recipe).validate(cfg, num_devices=len(devs)), devs))


class LLM:
    def __init__(self, model_path, dtype: str = "float32", *, dequantize_experts: bool = False, **engine_kwargs):
        placement = recipe_placement(model_path, engine_kwargs.get("recipe"), engine_kwargs.get("devices"))
        self.model = load_pretrained(model_path, dtype=dtype, dequantize_experts=dequantize_experts,
                                     placement=placement)
        self.engine = Engine(self.model, **engine_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in prompt order."""
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("need one SamplingParams per prompt (or a single one)")
        rids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            for out in self.engine.step():
                if out.finished:
                    done[out.rid] = out
        return [done[r] for r in rids]

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one delta per step that produced tokens for this prompt, the last finished."""
        rid = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.rid == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)
