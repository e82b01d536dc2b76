"""Child-process body for ``test_spec_engine.py`` (4 virtual CPU devices): greedy decoding with
speculation under a recipe against the same recipe without it, an oracle drafter injecting
wrong tokens (that a recipe equals one device is ``test_sharding.py``'s business). Prints one
JSON line: per recipe, tokens equal, drafts verified and accepted. With ``"dspark": [recipe or
null, ...]`` also DSpark under each of those recipes (its context rows in the recipe's pages,
proposed per rank; null: one device): its tokens and every block it proposed (the parent
compares them)."""
from __future__ import annotations

import json
import sys

import jax

from _util import load_case
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams
from test_spec_engine import K, OracleDrafter, _prompts


def run(model, recipe, prompts, params, **kw):
    """``(tokens, stats)`` of ``prompts`` run to the end on ``recipe`` (None: one device)."""
    from k3serve.sharding.recipe import Recipe

    n = Recipe.parse(recipe).devices if recipe else 1
    e = Engine(model, recipe=recipe, devices=jax.devices()[:n], max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=160, page_size=16, warmup=False, bucket_growth=16, **kw)
    rids = [e.add_request(p, params) for p in prompts]
    out, groups = {}, set()
    for _ in range(400):
        if not e.has_unfinished():
            break
        for o in e.step():
            if o.finished:
                out[o.rid] = o.token_ids
        groups.update(e.cache_mgr.group_of(r) for r in rids if r in e.cache_mgr)
    e.check_invariants()
    return [out[r] for r in rids], dict(e.stats(), groups=sorted(groups))


def main():
    spec = json.loads(sys.argv[1])
    model = load_case(spec["case"])
    V = model.config.vocab_size
    prompts = _prompts(V, seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    res, plains = {}, {}
    for recipe in spec["recipes"]:
        plain = plains[recipe] = run(model, recipe, prompts, params)[0]
        drafter = OracleDrafter({tuple(p): o + [0] * K for p, o in zip(prompts, plain)}, V)
        got, st = run(model, recipe, prompts, params, speculative={"num_speculative_tokens": K}, drafter=drafter)
        res[recipe] = {"equal": got == plain, "drafts": st["spec_draft_tokens"], "accepted": st["spec_accepted_tokens"],
                       "groups": st["groups"]}
    if spec.get("dspark"):
        import tempfile

        from k3serve.checkpoints.dspark_checkpoint import generate_dspark_checkpoint
        from test_dspark_engine import K as DK, RecordingDrafter, _draft_config

        ddir = generate_dspark_checkpoint(tempfile.mkdtemp(prefix="dspark-"), _draft_config(), seed=1)
        dspec = {"method": "dspark", "num_speculative_tokens": DK, "draft_model": str(ddir)}
        for recipe in spec["dspark"]:
            rec = RecordingDrafter(DK)
            plain = plains[recipe] if recipe in plains else run(model, recipe, prompts, params)[0]
            got, st = run(model, recipe, prompts, params, speculative=dspec, drafter=rec)
            res[f"dspark {recipe or 'one device'}"] = {
                "equal": got == plain, "accepted": st["spec_accepted_tokens"], "drafts": st["spec_draft_tokens"],
                "blocks": rec.blocks}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
