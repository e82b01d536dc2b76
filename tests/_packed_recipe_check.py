"""Child-process body for ``test_packed_rows.py`` (4 virtual CPU devices): the demo model in
bf16 under a recipe with its layer stacks packed (``Engine(pack_layer_stacks=True)``) against
the same recipe unpacked, greedy (a recipe against one device is ``test_sharding.py``'s).
Prints one JSON line: ``{recipe: {"packed": stacks packed, "local_rows_split": some packed
stack has its rows split over devices, "caller_adopted": the model given (loaded into the
recipe's shards) holds the engine's packed arrays, "tokens_equal"}}``."""
from __future__ import annotations

import json
import sys

import jax
from flax import nnx

from _util import run_to_end
from k3serve.checkpoints import load_pretrained
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.llm import recipe_placement
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.sharding.recipe import Recipe

PROMPTS = [[5, 7, 9, 11, 300, 17], list(range(1, 40)), [4000, 3, 3, 3]]


def tokens(engine) -> list:
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    rids = [engine.add_request(p, sp) for p in PROMPTS]
    out = [o.token_ids for o in run_to_end(engine, rids)]
    engine.check_invariants()
    return out


def main() -> None:
    ckpt, spec = sys.argv[1], json.loads(sys.argv[2])
    recipe = spec["recipe"]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, page_size=16, warmup=False,
              async_scheduling=False)
    n = Recipe.parse(recipe).devices
    want = tokens(Engine(load_pretrained(ckpt, dtype="bfloat16"), recipe=recipe, devices=jax.devices()[:n],
                         pack_layer_stacks=False, **kw))
    devices = jax.devices()[:n]
    caller = load_pretrained(ckpt, dtype="bfloat16", placement=recipe_placement(ckpt, recipe, devices))
    eng = Engine(caller, recipe=recipe, devices=devices, pack_layer_stacks=True, **kw)
    packed = split = 0
    theirs = {p: v.get_value() for p, v in nnx.to_flat_state(caller.params)}
    adopted = True
    for p, v in nnx.to_flat_state(eng.model.params):
        a = v.get_value()
        if a.dtype == "uint32":
            packed += 1
            split += a.sharding.shard_shape(a.shape)[-2] < a.shape[-2]
            adopted &= theirs[p] is a  # loaded into the shards: shared with the engine, so packed too
    print(json.dumps({recipe: {"packed": packed, "local_rows_split": bool(split), "caller_adopted": adopted,
                               "tokens_equal": tokens(eng) == want}}))


if __name__ == "__main__":
    main()
