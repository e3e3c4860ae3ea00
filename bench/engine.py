"""`specvoice bench engine`: controlled-acceptance benchmark of the speculative engine.

No downloaded weights: random-initialised models of real shapes are built directly on
the device (Qwen2.5-7B as the target, Qwen2.5-0.5B as the draft, written out below),
so it runs on a GPU machine without network. An oracle drafter proposes the target's
own greedy continuation with each token corrupted with probability 1 - a, at ~zero
cost, so the measured speedup isolates verification and the decoding loop; the draft
model's step cost is measured separately.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from bench import write_json

HELP = "engine at controlled acceptance: random 7B/0.5B-shaped models, oracle drafter, vs gamma 0 and HF generate"
DESCRIPTION = """\
Random-weight models of real shapes (no downloads), an oracle drafter that proposes
the target's own greedy continuation with each token corrupted with probability 1 - a
(cost ~0), greedy decoding, one prompt of random tokens. For each a and gamma:

  tokens_per_s              decode rate after the first token, best of --repeats
  speedup_vs_target_only    against the same engine at gamma = 0 (same fixed width)
  speedup_vs_hf_generate    against Hugging Face model.generate (greedy, same weights)
  tokens_per_pass           measured; expected_tokens_per_pass = E(g) = (1 - a^(g+1)) / (1 - a)
  measured_acceptance       accepted / (accepted + rejections): the oracle's realised a
  predicted_speedup         Leviathan: E(g) * T_pass(0) / (T_pass(g) + g * c_oracle), with the
                            target pass costs T measured here (at fixed width every pass runs
                            R = max gamma + 1 rows, so T_pass(g) = T(R)) and c_oracle measured
  efficiency                speedup_vs_target_only / predicted_speedup
  efficiency_realised       the same with the measured tokens_per_pass in place of E(g) (a short
                            run draws an acceptance that scatters around a)
  predicted_speedup_model_draft   the same formula with the draft model's measured step cost
  exact_vs_target_only      output token-identical to gamma = 0

and once: step_costs_s (target T(k) for k = 1..R rows, draft T(1), T(R)), verify_cost_ratio
(T(k) / T(1)), draft_step_ratio (draft T(1) / target T(1)), target_only, hf_generate.

examples:
  specvoice bench engine --out engine.json                       # 7B/0.5B shapes on CUDA, bf16
  specvoice bench engine --shapes small --device cpu             # tiny shapes, a few seconds
  specvoice bench engine --acceptance 0.8 --gammas 2 4 6 --new-tokens 256
"""

# Qwen2.5 configurations (config.json of the released checkpoints), as Qwen2Config kwargs.
QWEN25_7B = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
QWEN25_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
SMALL_TARGET = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=2048, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
SMALL_DRAFT = dict(SMALL_TARGET, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
SHAPES = {
    "7b-0.5b": (QWEN25_7B, QWEN25_05B),
    "0.5b-0.5b": (QWEN25_05B, QWEN25_05B),  # a 0.5B-shaped target: something a CPU can hold
    "small": (SMALL_TARGET, SMALL_DRAFT),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", choices=list(SHAPES), default="7b-0.5b", help="target-draft shapes (default 7b-0.5b)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32", "int8"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.8, 0.9], metavar="A")
    p.add_argument("--gammas", type=int, nargs="+", default=list(range(1, 9)), metavar="G")
    p.add_argument("--new-tokens", type=int, default=None, help="default: 128 (32 for --shapes small)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default: 128 (32 for --shapes small)")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting; the best tokens/s counts")
    p.add_argument("--fixed-width", action=argparse.BooleanOptionalAction, default=None,
                   help="static cache, every pass R rows (default: on; the path the GPU captures)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for --shapes small, whose ops are too small to share; else torch's)")
    p.add_argument("--no-hf", action="store_true", help="skip the hf_generate baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON results here")


# ---- models -----------------------------------------------------------------------------
def random_weights(cfg: dict, device, dtype, seed: int, std: float) -> dict:
    """Random weights of a Qwen2 model with Hugging Face parameter names, made on the device."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kv * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kv * d, h)
        w[p + "self_attn.q_proj.bias"] = rnd(heads * d)
        w[p + "self_attn.k_proj.bias"] = rnd(kv * d)
        w[p + "self_attn.v_proj.bias"] = rnd(kv * d)
        w[p + "self_attn.o_proj.weight"] = rnd(h, heads * d)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
    return w


def hf_from_weights(config, weights: dict, device):
    """A Hugging Face Qwen2ForCausalLM sharing `weights` (no copy, no random init)."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        hf = Qwen2ForCausalLM(config)
    missing, unexpected = hf.load_state_dict(weights, strict=False, assign=True)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weights do not fit Qwen2ForCausalLM: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # Non-persistent buffers (RoPE frequencies) were made on meta: rebuild them on the device.
    with torch.device(device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return hf.eval()


class _NoText:
    """The engine detokenizes as it streams; random models have no tokenizer."""

    def decode(self, ids, **kw) -> str:
        return ""


def build(cfg: dict, device: str, dtype: str, seed: int, with_hf: bool):
    """(our Transformer, HF model or None, config, linear mode) for random weights of shape `cfg`."""
    import torch
    from transformers import Qwen2Config

    from llm.loading import resolve_dtype
    from llm.model import build_model

    mode, torch_dtype = resolve_dtype(dtype, device)
    # Small shapes get a larger init so logits are peaked (greedy argmax then has no near-ties).
    std = 0.02 if cfg["hidden_size"] >= 512 else 0.1
    config = Qwen2Config(**cfg, torch_dtype=torch_dtype if mode != "int8" else torch.float32)
    weights = random_weights(cfg, device, torch_dtype if mode != "int8" else torch.float32, seed, std)
    model = build_model(config, weights, mode, torch_dtype, device)
    hf = hf_from_weights(config, weights, device) if with_hf else None
    del weights
    return model, hf, config, mode


# ---- measurements -----------------------------------------------------------------------
def decode_rate(stats) -> float:
    """Tokens per second after the first token (prefill and TTFT excluded)."""
    span = stats.total_s - (stats.ttft_s or 0.0)
    return (stats.new_tokens - 1) / span if span > 0 and stats.new_tokens > 1 else 0.0


def hf_decode_rate(hf, prompt: list[int], new_tokens: int, device: str) -> tuple[float, list[int]]:
    import torch

    from llm.cuda_graphs import synchronize

    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n):
        synchronize(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        synchronize(device)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    with torch.inference_mode():
        timed(2)  # warm-up
        t1, _ = timed(1)
        tn, out = timed(new_tokens)
    return (new_tokens - 1) / max(tn - t1, 1e-9), out


def expected_tokens(a: float, g: int) -> float:
    from llm.gamma import expected_tokens as e

    return e(a, g)


# ---- the run ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from llm.engine import SpeculativeEngine, fixed_width_options, one_gemm, time_steps
    from llm.gamma import GammaController
    from llm.loading import LoadedModel
    from llm.oracle import OracleDrafter, measured_acceptance
    from llm.types import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("specvoice bench engine: --device cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    fixed_width = True if args.fixed_width is None else args.fixed_width
    try:
        fixed_width, graphs = fixed_width_options(device, fixed_width, args.cuda_graphs)
    except ValueError as exc:
        print(f"specvoice bench engine: {exc}", file=sys.stderr)
        return 2
    if any(not 0.0 <= a < 1.0 for a in args.acceptance) or any(g < 1 for g in args.gammas) or (args.new_tokens or 2) < 2:
        print("specvoice bench engine: acceptance in [0, 1), gammas >= 1, --new-tokens >= 2", file=sys.stderr)
        return 2
    small = args.shapes == "small"
    threads = args.threads or (1 if small and not device.startswith("cuda") else None)
    if threads:
        torch.set_num_threads(threads)
    args.new_tokens = args.new_tokens or (32 if small else 128)
    args.prompt_tokens = args.prompt_tokens or (32 if small else 128)
    torch.manual_seed(args.seed)
    target_cfg, draft_cfg = SHAPES[args.shapes]
    gammas, accs = sorted(set(args.gammas)), list(args.acceptance)
    r = max(gammas) + 1
    context = args.prompt_tokens + args.new_tokens + 1
    reps = 7

    settings = [(a, g) for a in accs for g in gammas]
    total = 1 + r + 2 + 1 + args.repeats * (2 + len(settings)) + (0 if args.no_hf else 1)
    bar = tqdm(total=total, desc="bench engine", unit="step", file=sys.stderr, dynamic_ncols=True)

    bar.set_postfix_str(f"building {args.shapes} models on {device}")
    target, hf, _, mode = build(target_cfg, device, dtype, args.seed, with_hf=not args.no_hf)
    draft, _, _, _ = build(draft_cfg, device, dtype, args.seed + 1, with_hf=False)
    if fixed_width:
        one_gemm(target)
        one_gemm(draft)
    bar.update(1)

    # Step costs: the target at every width 1..R, the draft at 1 and R.
    bar.set_postfix_str("step costs")
    # Fixed-width steps, two warm-ups each (the first captures the graph).
    steps = {"repeats": reps, "warmup": 2, "fixed_width": True, "graphs": graphs}
    target_costs = time_steps(target, tuple(range(1, r + 1)), context, **steps)
    bar.update(r)
    draft_costs = time_steps(draft, (1, r), context, **steps)
    bar.update(2)
    del draft
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    engine = SpeculativeEngine(
        target=LoadedModel(f"random-{args.shapes.split('-')[0]}", target, _NoText(), frozenset(), ""),
        draft=None, drafter="none", gamma=0, max_gamma=r - 1, context_tokens=context,
        fixed_width=fixed_width, cuda_graphs=graphs,
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, target_cfg["vocab_size"], (args.prompt_tokens,), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    conv = engine.new_conversation()  # one static cache (one graph capture) for every run

    def generate(drafters, g):
        conv.drafters = drafters
        conv.controller = GammaController(max_gamma=g, fixed=g)
        ids, groups, stats = engine.generate(prompt, params, conv)
        return ids, groups, stats

    bar.set_postfix_str("warm-up")
    generate([], 0)  # prefill + graph capture; later runs prefill one token through the same path
    bar.update(1)

    base_rates, reference = [], None
    best: dict[tuple[float, int], dict] = {}
    base_pass = []

    def baseline():
        nonlocal reference
        ids, _, stats = generate([], 0)
        if reference is not None and ids != reference:
            raise RuntimeError("gamma = 0 gave different tokens on two runs of the same prompt")
        reference = ids
        base_rates.append(decode_rate(stats))
        base_pass.append(stats.verify_s / max(stats.passes - 1, 1))
        bar.update(1)

    for rep in range(args.repeats):
        bar.set_postfix_str(f"gamma 0 (run {rep + 1})")
        baseline()
        for i, (a, g) in enumerate(settings):
            bar.set_postfix_str(f"a={a} gamma={g}")
            # Same seed in every repeat: the same corruptions, so repeats differ only in timing.
            oracle = OracleDrafter(prompt, reference, a, target_cfg["vocab_size"], seed=args.seed * 100003 + i)
            ids, groups, stats = generate([oracle], g)
            rejections = sum(1 for grp in groups if grp.accepted < grp.drafted)
            row = {
                "acceptance": a,
                "gamma": g,
                "tokens_per_s": decode_rate(stats),
                "tokens_per_pass": (stats.new_tokens - 1) / max(stats.passes - 1, 1),
                "expected_tokens_per_pass": expected_tokens(a, g),
                "measured_acceptance": measured_acceptance(stats.accepted, stats.drafted, rejections),
                "drafted": stats.drafted,
                "accepted": stats.accepted,
                "rejections": rejections,
                "oracle_cost_per_token_s": oracle.cost_s / max(oracle.proposed, 1),
                "pass_s": stats.verify_s / max(stats.passes - 1, 1),
                "exact_vs_target_only": ids == reference,
            }
            old = best.get((a, g))
            if old is None or row["tokens_per_s"] > old["tokens_per_s"]:
                row["exact_vs_target_only"] = row["exact_vs_target_only"] and (old is None or old["exact_vs_target_only"])
                best[a, g] = row
            elif not row["exact_vs_target_only"]:
                old["exact_vs_target_only"] = False
            bar.update(1)
        baseline()  # again after the sweep: the machine's drift hits both sides

    hf_rate, hf_exact = None, None
    if hf is not None:
        bar.set_postfix_str("hf_generate")
        hf_rate, hf_ids = hf_decode_rate(hf, prompt, args.new_tokens, device)
        hf_exact = hf_ids == reference
        bar.update(1)
    bar.close()

    base_rate = max(base_rates)
    t1 = target_costs[1]
    # The target pass the engine runs for gamma g: R rows at fixed width, else g + 1 rows.
    t_pass = (lambda g: target_costs[r]) if fixed_width else (lambda g: target_costs[g + 1])
    results = []
    for (a, g), row in sorted(best.items()):
        e = expected_tokens(a, g)
        cost = t_pass(g) + g * row["oracle_cost_per_token_s"]
        predicted = e * t_pass(0) / cost
        # The same with the tokens per pass this run actually drew (a short run's realised
        # acceptance scatters around a): what is left is the implementation's own cost.
        predicted_realised = row["tokens_per_pass"] * t_pass(0) / cost
        speedup = row["tokens_per_s"] / base_rate if base_rate else 0.0
        row.update(
            speedup_vs_target_only=speedup,
            speedup_vs_hf_generate=row["tokens_per_s"] / hf_rate if hf_rate else None,
            predicted_speedup=predicted,
            efficiency=speedup / predicted if predicted else None,
            predicted_speedup_realised=predicted_realised,
            efficiency_realised=speedup / predicted_realised if predicted_realised else None,
            predicted_speedup_model_draft=e * t_pass(0) / (t_pass(g) + g * draft_costs[1]),
        )
        results.append(row)

    report = {
        "benchmark": "engine",
        "shapes": args.shapes,
        "models": {"target": target_cfg, "draft": draft_cfg},
        "config": {
            "device": device, "dtype": dtype, "linear_mode": "float" if fixed_width and mode == "rowwise" else mode,
            "fixed_width": fixed_width, "cuda_graphs": graphs, "verify_width": r,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "seed": args.seed, "acceptance": accs, "gammas": gammas,
        },
        "machine": machine(device),
        "step_costs_s": {
            "target": {str(k): v for k, v in target_costs.items()},
            "draft": {str(k): v for k, v in draft_costs.items()},
        },
        "verify_cost_ratio": {str(k): v / t1 for k, v in target_costs.items()},
        "draft_step_ratio": draft_costs[1] / t1,
        "target_only": {
            "tokens_per_s": base_rate,
            "pass_s": min(base_pass),
            # How close the gamma-0 loop runs to the bare step cost it is made of.
            "loop_efficiency": base_rate * t_pass(0),
        },
        "hf_generate": None if hf_rate is None else {
            "tokens_per_s": hf_rate,
            "exact_vs_target_only": hf_exact,
            "target_only_speedup": base_rate / hf_rate,
        },
        "results": results,
        "all_exact": all(row["exact_vs_target_only"] for row in results),
    }
    print_table(report)
    if args.out:
        write_json(args.out, report)
    return 0 if report["all_exact"] else 1


def machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def print_table(report: dict) -> None:
    c, steps = report["config"], report["step_costs_s"]
    t1 = steps["target"]["1"]
    where = report["machine"].get("gpu") or f"{report['machine']['cpu']} ({report['machine']['threads']} threads)"
    print(f"\n{report['shapes']} shapes, {c['dtype']} on {c['device']} ({where}); fixed width {c['fixed_width']} "
          f"(R = {c['verify_width']}), CUDA graphs {c['cuda_graphs']}; prompt {c['prompt_tokens']}, {c['new_tokens']} new tokens")
    ratios = "  ".join(f"{k}:{v:.2f}" for k, v in report["verify_cost_ratio"].items())
    print(f"target step T(1) = {t1 * 1e3:.2f} ms; verify cost T(k)/T(1): {ratios}")
    print(f"draft step = {steps['draft']['1'] * 1e3:.2f} ms = {report['draft_step_ratio']:.3f} x target step")
    base = report["target_only"]
    hf = report["hf_generate"]
    line = f"target_only (gamma 0): {base['tokens_per_s']:.1f} tok/s (loop efficiency {base['loop_efficiency']:.2f})"
    if hf:
        line += f"; hf_generate: {hf['tokens_per_s']:.1f} tok/s (exact vs target_only: {hf['exact_vs_target_only']})"
    print(line)
    print("eff = x gamma0 / pred (Leviathan, E(g) at a); eff* = the same with the measured tokens/pass; "
          "pred 0.5B = Leviathan with the draft model's step cost")
    head = f"{'a':>5} {'g':>3} {'tok/s':>9} {'x gamma0':>9} {'x hf':>7} {'tok/pass':>9} {'E(g)':>6} {'a meas':>7} {'pred':>6} {'eff':>6} {'eff*':>6} {'pred 0.5B':>9} {'exact':>6}"
    print(head)
    print("-" * len(head))
    for row in report["results"]:
        hfx = f"{row['speedup_vs_hf_generate']:.2f}" if row["speedup_vs_hf_generate"] is not None else "-"
        print(f"{row['acceptance']:>5.2f} {row['gamma']:>3d} {row['tokens_per_s']:>9.1f} {row['speedup_vs_target_only']:>9.2f} "
              f"{hfx:>7} {row['tokens_per_pass']:>9.2f} {row['expected_tokens_per_pass']:>6.2f} {row['measured_acceptance']:>7.2f} "
              f"{row['predicted_speedup']:>6.2f} {row['efficiency']:>6.2f} {row['efficiency_realised']:>6.2f} "
              f"{row['predicted_speedup_model_draft']:>9.2f} "
              f"{str(row['exact_vs_target_only']):>6}")
