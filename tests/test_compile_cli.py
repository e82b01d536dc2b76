"""``k3serve compile`` end to end: a small K3's serving programs compiled for an 8-device
tpu7x topology (``tpu7x:2x2x1``) under a recipe, through the CLI entry point, with --json;
with the reference kernels and with the Pallas kernels through Mosaic (the demo model, and a
small K3 at K3's head widths where all four kernels run).

Why: the command is how a configuration is checked against a TPU before a slice exists;
its JSON is what CI reads. These tests need libtpu (the ``tpu`` extra) and fail, not skip,
without it (``tpu_aot.require_libtpu``).
"""
from __future__ import annotations

import json
import os

import pytest

from k3serve.checkpoints.synthetic import k3_config
from k3serve.server.cli import main
from k3serve.sharding import tpu_aot

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _write_config(directory, **widths):
    """A 4-layer K3 (MLA at the last layer, layer 0 dense, MXFP4 experts) whose 8 heads split
    over an 8-device attention group, small widths unless ``widths`` says otherwise; its
    config.json path."""
    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, full_attn_layers=[4], kda_num_heads=8,
                kda_head_dim=16, mla_heads=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, num_experts=16, num_experts_per_token=4,
                num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=64,
                intermediate_size=96, attn_res_block_size=2)
    path = directory / "config.json"
    path.write_text(json.dumps(k3_config(**{**base, **widths})))
    return path


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    tpu_aot.require_libtpu()
    return _write_config(tmp_path_factory.mktemp("compile"))


def _compile(path, tmp_path, *flags, kernels="reference"):
    out = tmp_path / "report.json"
    rc = main(["compile", "--topology", "tpu7x:2x2x1", "--model", str(path), "--kernels", kernels,
               "--json", str(out), *flags])
    return rc, json.loads(out.read_text())


_SMALL_ENGINE = ("--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "512",
                 "--prefix-host-gb", "0", "--no-decode-costs")


def test_small_k3_compiles_every_serving_program_under_a_recipe(small_config, tmp_path, capsys):
    rc, rep = _compile(small_config, tmp_path, "--recipe", "ep=4,tp=2,dcp=8", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "4", "--max-model-len", "128", "--prefix-host-gb", "0",
                       "--no-decode-costs")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    assert rep["ok"] and rep["devices"] == 8 and rep["topology"] == "tpu7x:2x2x1" and rep["kernels"] == "reference"
    names = [p["name"] for p in rep["programs"]]
    # a step per token bucket (1, the row count), a sampler per row count, the table row, the
    # prefix-cache copies
    for want in ("step[T=1]", "step[T=4]", "sample[R=1]", "sample[R=4]", "table_row", "cache_pages[1]",
                 "cache_slots[1]"):
        assert want in names
    for p in rep["programs"]:
        assert p["ok"] and p["error"] is None and p["compile_s"] > 0
        m = p["bytes_per_device"]
        assert m["argument"] > 0 and m["code"] > 0 and p["bytes_accessed"] > 0
    step = next(p for p in rep["programs"] if p["name"] == "step[T=4]")
    assert step["flops"] > 0 and step["collectives"].get("ragged-all-to-all", 0) > 0  # EP dispatch on TPU
    assert rep["hbm_per_device"] == int(94.75 * 2**30)  # libtpu's figure for a v7x device
    pd = rep["per_device_bytes"]
    assert 0 < pd["plan"] < pd["compiler"] < rep["hbm_per_device"]
    assert rep["fits"] is True and "fits a device" in capsys.readouterr().out
    d = rep["decode"]
    assert d["bucket"] == 4 and d["plan_bytes"] > 0 and d["bytes_accessed"] is None  # --no-decode-costs


def _k3_head_widths(directory):
    """The 4-layer K3 of ``_write_config`` at the release's head widths (KDA 128, MLA latent 512
    + rope 64, 128-wide experts), one head per rank on 8 devices."""
    return _write_config(directory, hidden_size=256, kda_head_dim=128, q_lora_rank=128, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=128,
                         routed_expert_hidden_size=256, intermediate_size=256)


@pytest.mark.slow  # four programs (~70 s on 2 cores)
def test_decode_step_costs_are_summed_over_layers_and_its_collectives_are_the_planners(tmp_path):
    """The decode step's costs come from one program per layer kind (the anchor, then two more
    layers of each kind: half the difference is a layer's), and the compiled step runs exactly the collectives the planner counts
    (``roofline.step_collectives``): per layer 2 TP reductions, 6 for the EP exchange of a latent
    MoE under EP x TP (input gather, sizes, dispatch, gather of h over tp, combine, output
    gather), 4 more for an MLA layer under DCP; the partitioner adds none. (At the tiny widths
    of ``small_config``, 8 heads of 16, the partitioner reshards the KDA path instead: 109
    collectives against 31. K3's widths are what the planner is for.)"""
    tpu_aot.require_libtpu()
    rc, rep = _compile(_k3_head_widths(tmp_path), tmp_path, "--recipe", "ep=4,tp=2,dcp=8", "--max-num-seqs", "8",
                       "--max-num-batched-tokens", "8", "--max-model-len", "128", "--prefix-host-gb", "0",
                       "--only", "decode", kernels="pallas")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    assert [p["name"] for p in rep["programs"]] == [  # the anchor (one layer per attention type), + 2 of each kind
        "decode_layers[kda+moe mla+moe]", "decode_layers[kda+moe mla+moe kda+mlp kda+mlp]",
        "decode_layers[kda+moe mla+moe kda+moe kda+moe]", "decode_layers[kda+moe mla+moe mla+moe mla+moe]"]
    d = rep["decode"]
    assert set(d["per_layer"]) == {"kda+mlp", "kda+moe", "mla+moe"}
    assert d["per_layer"]["kda+moe"]["layers"] == 2  # layers 1, 2 (0 is dense, 3 is MLA)
    for f in d["per_layer"].values():
        assert f["bytes_accessed"] > 0 and f["flops"] > 0 and f["collectives"] > 0
    assert d["bytes_accessed"] > max(f["bytes_accessed"] for f in d["per_layer"].values())
    assert d["plan_bytes"] > 0
    assert {k: f["collectives"] for k, f in d["per_layer"].items()} == {"kda+mlp": 2, "kda+moe": 8, "mla+moe": 12}
    assert d["plan_collective_parts"] == {"TP reductions": 8, "EP exchange": 18, "DCP (MLA)": 4, "LM head": 1}, d
    assert d["collectives"] == d["plan_collectives"] == 31, d


def test_a_recipe_the_topology_cannot_hold_fails_with_its_error(small_config, tmp_path):
    rc, rep = _compile(small_config, tmp_path, "--recipe", "ep=8,tp=2")  # 16 devices on 8
    assert rc == 1 and rep["ok"] is False
    assert "16" in rep["error"] and "8" in rep["error"]


def test_demo_model_with_pallas_kernels_compiles_under_attention_dp(tmp_path):
    """The demo model (``make serve``'s) under ``test-8-dp2`` with the Pallas backend, through
    Mosaic: its step programs compile and call the MLA and grouped-matmul kernels. Its KDA
    heads are 64 wide (the kernels need 128-lane heads: ``ops.kda_kernels_fit``), so its KDA
    layers run the reference path. The one-token step is the one that failed XLA:TPU's
    reduce-scatter legalizer (a RET_CHECK) while the step's metadata went in unplaced: the
    partitioner split its row columns one per shard (the runner now places it replicated)."""
    tpu_aot.require_libtpu()
    rc, rep = _compile("demo", tmp_path, "--recipe", "test-8-dp2", *_SMALL_ENGINE, "--only", "^step", kernels="pallas")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    assert rep["kernels"] == "pallas" and rep["fits"] is True
    steps = {p["name"]: p for p in rep["programs"]}
    assert set(steps) == {"step[T=1]", "step[T=2]", "step[T=16]"}  # tokens per DP group
    for p in steps.values():
        assert set(p["kernels"]) == {"mxfp4_gmm", "mla_ragged_attention_kernel"}, p["kernels"]


def test_k3_head_widths_compile_all_four_kernels_under_a_recipe(tmp_path):
    """A 4-layer K3 at the release's head widths (KDA 128, MLA latent 512 + rope 64, 128-wide
    experts) on 8 devices (EP4 x TP2, DCP8), one head per rank: the step program calls all four
    Mosaic kernels; its page table (8 pages a row) is fetched into SMEM as one 128-column chunk
    (Mosaic's DMAs move multiples of 512 bytes). With speculation on, the speculative step runs
    the KDA record mode per rank (each rank on its block of the journal) in place of the
    decode kernel."""
    tpu_aot.require_libtpu()
    path = _k3_head_widths(tmp_path)
    rc, rep = _compile(path, tmp_path, "--recipe", "ep=4,tp=2,dcp=8", *_SMALL_ENGINE, "--only", r"^step\[T=4",
                       "--speculative", "ngram", "--num-speculative-tokens", "3", kernels="pallas")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    step, spec = rep["programs"]
    assert step["name"] == "step[T=4]" and spec["name"] == "step[T=4,spec]"
    assert set(step["kernels"]) == {"mxfp4_gmm", "mla_ragged_attention_kernel", "kda_decode", "kda_prefill"}
    assert set(spec["kernels"]) == {"mxfp4_gmm", "mla_ragged_attention_kernel", "kda_spec_decode", "kda_prefill"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_role_compiles_its_handoff_programs(small_config, tmp_path, role):
    """``--role``: a P/D prefill server's exports (reads) and the cuts a decode can ask of them
    (``deal.warm_cuts``), a decode server's imports (loads at ``dp * dcp * Pb`` pages) -- the
    programs ``serve --role`` warms -- compile for TPU under a recipe with DCP."""
    rc, rep = _compile(small_config, tmp_path, "--recipe", "ep=4,tp=2,dcp=8", *_SMALL_ENGINE[:-1],
                       "--role", role, "--only", "^(cache_read|cache_load|deal)", "--no-decode-costs")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    names = [p["name"] for p in rep["programs"]]
    if role == "prefill":  # 512 tokens of 16-token pages: exports of 1..32 pages; 8 heads
        assert "cache_read[32]" in names and not any(n.startswith("cache_load") for n in names), names
        assert {f"deal[32]:heads[{c}]" for c in (1, 2, 4, 8)} | {f"deal[32]:pages[{p}]" for p in (1, 2, 32)} \
            <= set(names), names
    else:  # dp * dcp * Pb pages, Pb = 1, 2, 4 (32 pages over 8 DCP ranks)
        assert {"cache_load[8]", "cache_load[16]", "cache_load[32]"} <= set(names), names
        assert not any(n.startswith("deal") for n in names), names
    assert all(p["ok"] for p in rep["programs"])


def test_a_conds_collectives_count_as_its_larger_branch():
    """One branch of a ``lax.cond`` runs: its collectives count as the larger branch's (the EP
    exchange's capped and worst-case paths), the rest as they are, a ``-done`` never."""
    line = '  %{n} = f32[8] {op}(%p), metadata={{op_name="jit(f)/shard_map/{where}ragged_all_to_all"}}'
    text = "\n".join([
        line.format(n="a", op="all-gather", where=""),
        line.format(n="b", op="ragged-all-to-all", where="cond/branch_0_fun/"),
        line.format(n="c", op="ragged-all-to-all", where="cond/branch_1_fun/"),
        line.format(n="d", op="all-gather-start", where="cond/branch_1_fun/"),
        line.format(n="e", op="all-gather-done", where="cond/branch_1_fun/"),
        line.format(n="f", op="ragged-all-to-all", where="cond/branch_0_fun/"),
    ])
    assert tpu_aot.collective_counts(text) == {"all-gather": 1, "ragged-all-to-all": 2}


def test_speculative_steps_compile_with_the_journal(small_config, tmp_path):
    """Speculation (k = 3) under EP4 x TP2 x DCP8 with the Pallas kernels (16-wide KDA heads do
    not fit the KDA kernels, so KDA takes the reference path; the record-mode kernel per rank
    is compiled by ``test_k3_head_widths_compile_all_four_kernels_under_a_recipe``): both step programs of each bucket (plain, and
    speculative with the journal) and the three samplers of each row count (plain, speculative
    with and without per-position table rows) compile for tpu7x, and the journal is counted per
    device (split over the KDA heads: its full size / 8)."""
    from k3serve.model.config import K3Config
    from k3serve.model.k3 import journal_shapes

    # a 4-token budget: token buckets 1 and 4 (the row count), each with its plain and its
    # speculative step, and the samplers of 1 and 4 rows (a 16-token budget added a third
    # bucket, two more step programs of the same kind: ~20 s of TPU compiles)
    engine = ("--max-num-seqs", "4", "--max-num-batched-tokens", "4", *_SMALL_ENGINE[4:])
    rc, rep = _compile(small_config, tmp_path, "--recipe", "ep=4,tp=2,dcp=8", *engine, "--only", "^(step|sample)",
                       "--speculative", "ngram", "--num-speculative-tokens", "3", kernels="pallas")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    names = [p["name"] for p in rep["programs"]]
    for want in [f"step[T={t}{s}]" for t in (1, 4) for s in ("", ",spec")] + \
            [f"sample[R={r}{s}]" for r in (1, 4) for s in ("", ",spec", ",spec,table")]:
        assert want in names, names
    import numpy as np

    cfg = K3Config.from_json_file(small_config)
    full = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in journal_shapes(cfg, 4, 3, "float32"))
    assert rep["compiler_parts"]["journal"] == full // 8


def test_dspark_compiles_its_draft_programs(small_config, tmp_path):
    """DSpark (k = 3) under EP4 x TP2 x DCP8 with the Pallas kernels, the draft built from its
    config.json alone (no weights): each bucket's speculative step (the target's taps out) and
    its draft program (context rows written on the rank owning the page, the block attending
    per DCP rank through the MLA kernel, the partials merged) compile for tpu7x; a DSpark engine
    has no plain step program; the draft's weights count whole on every device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from k3serve.checkpoints.dspark_checkpoint import dspark_config_for
    from k3serve.model.config import K3Config
    from k3serve.model.dspark import DSparkDraft
    from k3serve.model.dspark_config import DSparkConfig

    d = tmp_path / "draft"
    d.mkdir()
    dcfg = dspark_config_for(K3Config.from_json_file(small_config), block_size=4)
    (d / "config.json").write_text(json.dumps(dcfg))
    engine = ("--max-num-seqs", "4", "--max-num-batched-tokens", "4", *_SMALL_ENGINE[4:])
    rc, rep = _compile(small_config, tmp_path, "--recipe", "ep=4,tp=2,dcp=8", *engine, "--only", "^(step|draft)",
                       "--speculative", "dspark", "--num-speculative-tokens", "3", "--draft-model", str(d),
                       kernels="pallas")
    assert rc == 0, [p["error"] for p in rep["programs"] if not p["ok"]]
    names = [p["name"] for p in rep["programs"]]
    assert names == ["step[T=1,spec]", "draft[T=1]", "step[T=4,spec]", "draft[T=4]"], names
    draft = nnx.eval_shape(lambda: DSparkDraft(DSparkConfig.from_dict(dcfg), jnp.float32))
    assert rep["compiler_parts"]["draft_weights"] == sum(
        int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(nnx.state(draft)))
