"""Regenerate Kimi-Linear golden reference data with PyTorch + Hugging Face transformers.

Why: ``tests/data/kimi-linear-tiny/golden.npz`` was produced by transformers'
``KimiLinearForCausalLM`` (float32, CPU, eager attention, transformers' pure-torch KDA and
short-convolution fallbacks). This script is the recipe for that file. It rebuilds the same
arrays for any Kimi-Linear checkpoint, in the original Kimi-Linear tensor names or in those
transformers >= 5 saves (see ``--init-config`` below), and it can check
a new run against an existing golden file (``--compare``).

Each prompt is run alone (batch 1). These arrays are written for each sequence i:

  input_ids_i             int32 [L]      the prompt
  prefill_logits_i        float32 [L, V] one cached forward over the prompt
  gen_tokens_i            int32 [N]      greedy tokens: gen[0] = argmax(prefill_logits[-1]),
                                         gen[j+1] = argmax(decode_logits[j])
  decode_logits_i         float32 [N, V] step-by-step decode with the transformers cache;
                                         row j holds the logits after feeding gen[j]
  next_token_after_gen_i  int32 []       argmax(decode_logits[N-1])
  gen_margins_i           float32 [N]    top1 - top2 of the logits row that chose gen[j]
  full_ids_i              int32 [L+N]    prompt + generation
  full_logits_i           float32 [L+N, V] one uncached, teacher-forced forward over full_ids_i

The file also holds ``lengths`` (int32 [S], the prompt lengths) and ``num_generated``
(int32 scalar N).

Dependencies: these are NOT project dependencies. Install them in a separate venv outside the
repo, and keep triton out of that venv. With triton installed, transformers picks
flash-linear-attention's triton kernels, and those fail on a machine without a GPU
("0 active drivers").

    python3 -m venv .peer-venv
    .peer-venv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy

    .peer-venv/bin/python tools/gen_kimi_linear_golden.py --model tests/data/kimi-linear-tiny \\
        --prompts from-golden:tests/data/kimi-linear-tiny/golden.npz --out kl.npz \\
        --compare tests/data/kimi-linear-tiny/golden.npz
    .peer-venv/bin/python tools/gen_kimi_linear_golden.py --model DIR \\
        --prompts random:0:64,5 --out kl_random.npz

``--init-config CONFIG --seed N`` first makes the checkpoint itself: transformers builds
``KimiLinearForCausalLM`` from CONFIG with random weights (``torch.manual_seed(N)``, transformers'
own initialisation), casts it to ``--init-dtype`` and writes it to ``--model`` with
``save_pretrained``. Such a checkpoint has transformers' save-time tensor names: transformers >= 5
renames ``.mlp.`` to ``.block_sparse_moe.`` on save, so a dense layer (``first_k_dense_replace``)
is written as ``model.layers.0.block_sparse_moe.{gate,up,down}_proj.weight`` where the original
release writes ``model.layers.0.mlp.*``. ``tests/data/kimi-linear-tiny-dense`` was made this way:

    .peer-venv/bin/python tools/gen_kimi_linear_golden.py --model tests/data/kimi-linear-tiny-dense \\
        --init-config tests/data/kimi-linear-tiny-dense/config.json --seed 0 --init-dtype bfloat16 \\
        --prompts random:7:29,16,3 --out tests/data/kimi-linear-tiny-dense/golden.npz

Its config.json is the one transformers wrote (initializer_range 0.5, so that the logits have
the scale of kimi-linear-tiny's); with torch 2.13.0 (CPU) and transformers 5.23.0 the command
rewrites config.json, model.safetensors and golden.npz byte for byte.

The tests never import this script, and k3serve's own code must not import it either: the test
suite does not depend on torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_NUM_GENERATED = 12
DEFAULT_RTOL = 1e-4


# ----------------------------------------------------------------------------------------------
# Prompts

def parse_prompts(spec: str, vocab_size: int) -> tuple[list[np.ndarray], int | None]:
    """Return (prompt id arrays, num_generated recorded in the source golden, or None)."""
    if spec.startswith("from-golden:"):
        path = Path(spec[len("from-golden:"):])
        with np.load(path) as g:
            lengths = [int(x) for x in g["lengths"]]
            prompts = [g[f"input_ids_{i}"].astype(np.int64) for i in range(len(lengths))]
            n_gen = int(g["num_generated"]) if "num_generated" in g.files else None
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            if p.shape != (n,):
                raise SystemExit(f"{path}: input_ids_{i} has shape {p.shape}, lengths says {n}")
        return prompts, n_gen
    if spec.startswith("random:"):
        m = re.fullmatch(r"random:(\d+):(\d+(?:,\d+)*)", spec)
        if not m:
            raise SystemExit(f"bad --prompts {spec!r}: expected random:SEED:LEN1,LEN2,...")
        rng = np.random.default_rng(int(m.group(1)))
        lens = [int(x) for x in m.group(2).split(",")]
        if any(n < 1 for n in lens):
            raise SystemExit("prompt lengths must be >= 1")
        return [rng.integers(0, vocab_size, size=n, dtype=np.int64) for n in lens], None
    raise SystemExit(f"bad --prompts {spec!r}: expected from-golden:PATH or random:SEED:LEN1,LEN2,...")


# ----------------------------------------------------------------------------------------------
# Checkpoint check, independent of transformers' loader

def read_checkpoint(model_dir: Path):
    """All tensors of model.safetensors (or a sharded index) as float32 torch tensors."""
    import torch
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(model_dir / f)).items():
            out[k] = v.to(torch.float32)
    return out


def to_transformers_layout(ckpt):
    """Map original Kimi-Linear names to the parameter names of transformers' KimiLinearForCausalLM.

    This is our own statement of the layout, written to check what transformers loaded:
      self_attn.{f_a_proj,f_b_proj,dt_bias,A_log} -> self_attn.forget_gate.*
      self_attn.{q,k,v}_conv1d.*                  -> self_attn.conv1d.* (q|k|v stacked on dim 0)
      block_sparse_moe.*                          -> mlp.*
      experts.{e}.w1 / w3 [I, D]                  -> experts.gate_up_proj [E, 2I, D] (w1 rows first)
      experts.{e}.w2 [D, I]                       -> experts.down_proj [E, D, I]
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    conv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in ckpt.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := re.fullmatch(r"(.*\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", name):
            out[f"{m.group(1)}.forget_gate.{m.group(2)}"] = t
        elif m := re.fullmatch(r"(.*\.self_attn)\.([qkv])_conv1d\.(weight|bias)", name):
            conv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = t
        elif m := re.fullmatch(r"(.*\.experts)\.(\d+)\.(w[123])\.weight", name):
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for (prefix, kind), parts in conv.items():
        if set(parts) != {"q", "k", "v"}:
            raise SystemExit(f"{prefix}: incomplete q/k/v conv1d {kind} in the checkpoint: {sorted(parts)}")
        out[f"{prefix}.conv1d.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        missing = [f"{e}.{w}" for e in range(n) for w in ("w1", "w2", "w3") if (e, w) not in parts]
        if missing:
            raise SystemExit(f"{prefix}: missing expert weights {missing[:6]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "w1")], parts[(e, "w3")]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "w2")] for e in range(n)])
    return out


def verify_and_fix_weights(model, model_dir: Path) -> list[str]:
    """Check every parameter of the loaded model against the checkpoint; return notes.

    A tensor whose shape differs only by a reshape (same number of elements, e.g. A_log stored
    as [H] instead of [1, 1, H, 1]) is copied in and reported. Anything else that does not
    match is an error, because a silently random-initialised parameter would poison the golden.
    """
    import torch

    want = to_transformers_layout(read_checkpoint(model_dir))
    have = model.state_dict()
    notes: list[str] = []
    errors: list[str] = []
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in have.items():
        ref = want.get(name)
        if ref is None and tied and name == "lm_head.weight":
            ref = want.get("model.embed_tokens.weight")
        if ref is None:
            errors.append(f"{name}: not in the checkpoint (left at its initial value)")
            continue
        if param.dtype != torch.float32:
            errors.append(f"{name}: loaded as {param.dtype}, expected float32")
            continue
        if tuple(ref.shape) != tuple(param.shape):
            if ref.numel() != param.numel():
                errors.append(f"{name}: checkpoint shape {tuple(ref.shape)}, model {tuple(param.shape)}")
                continue
            with torch.no_grad():
                param.copy_(ref.reshape(param.shape))
            notes.append(f"{name}: reshaped checkpoint {tuple(ref.shape)} -> {tuple(param.shape)}")
            continue
        if not torch.equal(param.detach().float(), ref):
            diff = (param.detach().float() - ref).abs().max().item()
            errors.append(f"{name}: loaded values differ from the checkpoint (max abs {diff:.3g})")
    unused = sorted(set(want) - set(have))
    if unused:
        errors.append(f"checkpoint tensors the model has no place for: {unused[:8]}"
                      + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else ""))
    if errors:
        raise SystemExit("weight check failed:\n  " + "\n  ".join(errors))
    return notes


# ----------------------------------------------------------------------------------------------
# Model

def init_checkpoint(config_path: Path, model_dir: Path, seed: int, dtype: str) -> None:
    """Build a randomly initialised KimiLinearForCausalLM from a config and save_pretrained it."""
    import torch
    from safetensors import safe_open
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig.from_json_file(str(config_path))  # read before model_dir is written
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).to(getattr(torch, dtype))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(model_dir))
    n = sum(p.numel() for p in model.parameters())
    print(f"initialised {n} parameters from {config_path} (seed {seed}, {dtype}) and saved them to {model_dir}")
    names: list[str] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names += list(h.keys())
    dense = sorted(k for k in names if re.search(r"\.layers\.\d+\.(mlp|block_sparse_moe)\.(gate|up|down)_proj\.", k))
    print(f"  dense-MLP tensors as saved: {dense or 'none'}")


def load_model(model_dir: Path, threads: int | None):
    import torch
    import transformers
    from transformers import KimiLinearForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)  # only matters for parameters the checkpoint fails to cover (which is an error)
    model, info = KimiLinearForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch.float32,
        attn_implementation="eager",
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # mismatches are repaired or rejected by verify_and_fix_weights
    )
    model.eval()
    print(f"loaded {model_dir} with transformers {transformers.__version__}: "
          f"missing={sorted(info['missing_keys'])} unexpected={sorted(info['unexpected_keys'])} "
          f"mismatched={sorted(k[0] if isinstance(k, tuple) else k for k in info['mismatched_keys'])}")
    for note in verify_and_fix_weights(model, model_dir):
        print(f"  weight fix-up: {note}")
    print(f"  weight check: all {len(model.state_dict())} parameters equal the checkpoint (float32)")
    return model


def _margin(row) -> float:
    top = row.topk(2).values
    return float(top[0] - top[1])


def run_sequence(model, prompt: np.ndarray, num_generated: int) -> dict[str, np.ndarray]:
    import torch
    from transformers import DynamicCache

    L = int(prompt.shape[0])
    ids = torch.as_tensor(prompt, dtype=torch.long)[None]
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, position_ids=torch.arange(L)[None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        prefill = out.logits[0].float()
        chooser = prefill[-1]
        gen: list[int] = []
        margins: list[float] = []
        decode_rows = []
        for j in range(num_generated):
            tok = int(chooser.argmax())
            gen.append(tok)
            margins.append(_margin(chooser))
            out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[L + j]]),
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            chooser = out.logits[0, -1].float()
            decode_rows.append(chooser)
        next_tok = int(chooser.argmax())
        full_ids = np.concatenate([prompt.astype(np.int64), np.asarray(gen, dtype=np.int64)])
        full = model(input_ids=torch.as_tensor(full_ids)[None], position_ids=torch.arange(full_ids.size)[None],
                     use_cache=False).logits[0].float()
    decode = torch.stack(decode_rows) if decode_rows else prefill.new_zeros((0, prefill.shape[-1]))
    return {
        "input_ids": prompt.astype(np.int32),
        "prefill_logits": prefill.numpy().astype(np.float32),
        "gen_tokens": np.asarray(gen, dtype=np.int32),
        "decode_logits": decode.numpy().astype(np.float32),
        "next_token_after_gen": np.asarray(next_tok, dtype=np.int32),
        "gen_margins": np.asarray(margins, dtype=np.float32),
        "full_ids": full_ids.astype(np.int32),
        "full_logits": full.numpy().astype(np.float32),
    }


def check_generate(model, prompt: np.ndarray, num_generated: int) -> np.ndarray:
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long)[None]
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=num_generated, min_new_tokens=num_generated,
                             pad_token_id=model.config.pad_token_id)
    return out[0, ids.shape[1]:].numpy().astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Comparison

def _rel(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    if a.size == 0:
        return 0.0, 0.0
    d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    scale = float(np.max(np.abs(b)))
    return d, d / scale if scale > 0 else d


def compare(new: dict[str, np.ndarray], ref_path: Path, rtol: float) -> bool:
    ok = True
    with np.load(ref_path) as ref_file:
        ref = {k: ref_file[k] for k in ref_file.files}
    only_new, only_ref = sorted(set(new) - set(ref)), sorted(set(ref) - set(new))
    if only_new or only_ref:
        print(f"array names differ: only here {only_new}, only in {ref_path} {only_ref}")
        ok = False
    print(f"{'array':<26} {'shape':<12} {'result'}")
    for name in sorted(set(new) & set(ref), key=_sort_key):
        a, b = new[name], ref[name]
        shape = "x".join(map(str, a.shape)) or "()"
        if a.shape != b.shape or a.dtype != b.dtype:
            print(f"{name:<26} {shape:<12} MISMATCH: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
            ok = False
        elif np.issubdtype(a.dtype, np.integer):
            n_diff = int(np.sum(a != b))
            print(f"{name:<26} {shape:<12} {'identical' if n_diff == 0 else f'DIFFERENT at {n_diff} positions'}")
            ok &= n_diff == 0
        else:
            d, r = _rel(a, b)
            bad = not (r <= rtol)
            print(f"{name:<26} {shape:<12} max abs {d:.3e}  rel {r:.3e}{'  > rtol' if bad else ''}")
            ok &= not bad
    print(f"compare with {ref_path}: {'OK' if ok else 'FAILED'} (requires identical token arrays and float rel <= {rtol:g})")
    return ok


def _sort_key(name: str):
    m = re.fullmatch(r"(.*)_(\d+)", name)
    return (int(m.group(2)), m.group(1)) if m else (-1, name)


# ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True,
                    help="Kimi-Linear HF dir: config.json + model.safetensors (original or transformers tensor names); "
                         "with --init-config it is written first")
    ap.add_argument("--out", type=Path, required=True, help="output .npz")
    ap.add_argument("--prompts", required=True,
                    help="from-golden:PATH (reuse input_ids_i of an existing golden) or random:SEED:LEN1,LEN2,...")
    ap.add_argument("--num-generated", type=int, default=None,
                    help=f"greedy tokens per prompt (default: the golden's num_generated with from-golden, "
                         f"else {DEFAULT_NUM_GENERATED})")
    ap.add_argument("--compare", type=Path, help="existing golden .npz to compare the new arrays with")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                    help=f"--compare fails above this max|diff| / max|ref| for float arrays (default {DEFAULT_RTOL:g})")
    ap.add_argument("--check-generate", action="store_true",
                    help="also check that model.generate(do_sample=False) reproduces gen_tokens_i")
    ap.add_argument("--init-config", type=Path, default=None,
                    help="first create --model: a randomly initialised KimiLinearForCausalLM built from this "
                         "config.json and written with transformers' save_pretrained (transformers' tensor names)")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed for --init-config (default 0)")
    ap.add_argument("--init-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="dtype the --init-config checkpoint is saved in (default bfloat16)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads; 0 = torch's default (default 1: a fixed reduction order, and "
                         "several times faster than 2 threads for these tiny shapes)")
    args = ap.parse_args(argv)

    if importlib.util.find_spec("triton") is not None:
        raise SystemExit("triton is installed in this environment: transformers would then route KDA to "
                         "flash-linear-attention's triton kernels, which fail without a GPU. "
                         "Use a venv without triton (see this script's docstring).")
    if args.num_generated is not None and args.num_generated < 1:
        ap.error("--num-generated must be >= 1")

    import torch
    import transformers

    t0 = time.perf_counter()
    config = json.loads((args.init_config or args.model / "config.json").read_text())
    vocab = int(config.get("text_config", config)["vocab_size"])
    prompts, golden_n = parse_prompts(args.prompts, vocab)
    n_gen = args.num_generated or golden_n or DEFAULT_NUM_GENERATED
    if golden_n is not None and n_gen != golden_n:
        print(f"note: --num-generated {n_gen} differs from the source golden's {golden_n}")
    bad = [int(p.max()) for p in prompts if p.size and (p.max() >= vocab or p.min() < 0)]
    if bad:
        raise SystemExit(f"prompt ids outside the vocabulary (size {vocab}): {bad}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}, "
          f"flash-linear-attention {'present' if importlib.util.find_spec('fla') else 'absent'}, triton absent")

    if args.init_config is not None:
        init_checkpoint(args.init_config, args.model, args.seed, args.init_dtype)
    model = load_model(args.model, args.threads)
    arrays: dict[str, np.ndarray] = {
        "lengths": np.asarray([p.size for p in prompts], dtype=np.int32),
        "num_generated": np.asarray(n_gen, dtype=np.int32),
    }
    for i, prompt in enumerate(prompts):
        t = time.perf_counter()
        seq = run_sequence(model, prompt, n_gen)
        for k, v in seq.items():
            arrays[f"{k}_{i}"] = v
        # Self-checks: cached prefill/decode against the uncached teacher-forced forward.
        L = prompt.size
        _, r_pre = _rel(seq["prefill_logits"], seq["full_logits"][:L])
        _, r_dec = _rel(seq["decode_logits"], seq["full_logits"][L:])
        line = (f"seq {i}: len {L}, gen {seq['gen_tokens'].tolist()} -> {int(seq['next_token_after_gen'])}, "
                f"min margin {float(seq['gen_margins'].min()):.3g}, prefill vs full rel {r_pre:.2e}, "
                f"decode vs full rel {r_dec:.2e}")
        if args.check_generate:
            same = np.array_equal(check_generate(model, prompt, n_gen), seq["gen_tokens"])
            line += f", generate() {'agrees' if same else 'DISAGREES'}"
        print(f"{line} ({time.perf_counter() - t:.1f} s)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **arrays)
    print(f"wrote {args.out} ({len(arrays)} arrays, {time.perf_counter() - t0:.1f} s)")

    if args.compare is not None and not compare(arrays, args.compare, args.rtol):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
