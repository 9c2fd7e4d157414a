"""Real models through torch.compile: eager vs Inductor vs egraph-compiler.

    python -m benchmarks.models [--size test|cpu|gpu] [--device cpu|cuda]
                                [--dtype float32|bfloat16] [--models gpt2,bert,llama_gqa,vit]
                                [--reps N] [--mode reduce-overhead] [--json PATH]

Small random-weight `transformers` models (GPT-2, BERT, LLaMA with grouped-query
attention over 2 of 4 KV heads, ViT), in eval mode under torch.no_grad(), with
use_cache off.  One process, the same inputs for every variant; Inductor and ours
both go through torch.compile (default mode; ours is `backend="egraph"`), and both
are checked against eager before they are timed (below float32, against the float32
model, within twice eager's own error: benchmarks.run.check).  Timing as in benchmarks.run:
blocks of back-to-back calls, the variants interleaved per round, medians of the
rounds.  Also reported: cold compile (first call) time, and ours' kernels by kind
(generated / library / aten) with the ATen fallbacks named.
"""
from __future__ import annotations

import sys
import time

import torch

import egraph_compiler as egc
from benchmarks.common import interleaved, model_parser, run_models
from benchmarks.kernels import kernel_times
from benchmarks.run import TOL, check, short_error
from benchmarks.timing import sync, time_block

SIZES = {  # layers, hidden, heads, batch, sequence (ViT: image side = 4 * sequence ** 0.5)
    "test": dict(layers=2, hidden=64, heads=4, batch=2, seq=16),
    "cpu": dict(layers=2, hidden=256, heads=4, batch=4, seq=128),
    "gpu": dict(layers=4, hidden=512, heads=8, batch=8, seq=512),
}
MODELS = ("gpt2", "bert", "llama_gqa", "vit")


def make(name: str, s: dict, device: str, dtype: torch.dtype):
    """(model, inputs): a random-weight model of this family and a batch for it."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                  intermediate_size=4 * s["hidden"])
    ids = torch.randint(0, 512, (s["batch"], s["seq"]))
    if name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"],
                                                 vocab_size=512, n_positions=s["seq"], use_cache=False))
    elif name == "bert":
        model = tf.BertModel(tf.BertConfig(vocab_size=512, max_position_embeddings=s["seq"], **common))
    elif name == "llama_gqa":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=512, num_key_value_heads=s["heads"] // 2,
                                                   use_cache=False, **common))
    elif name == "vit":
        side = 4 * int(s["seq"] ** 0.5)
        model = tf.ViTModel(tf.ViTConfig(image_size=side, patch_size=4, **common))
        ids = torch.randn(s["batch"], 3, side, side)
    else:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    model = model.eval().to(device=device, dtype=dtype)
    ids = ids.to(device=device, dtype=dtype if ids.is_floating_point() else ids.dtype)
    return model, [ids]


def _main_output(out) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        if hasattr(out, key):
            return getattr(out, key)
    return out[0] if isinstance(out, (tuple, list)) else out


def bench_model(name: str, args) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    model, inputs = make(name, SIZES[args.size], device, dtype)
    row: dict = {"model": name, "status": {"eager": "ok"}, "compile_s": {}, "ms": {}}
    callables = {"eager": lambda *a: _main_output(model(*a))}
    with torch.no_grad():
        ref = callables["eager"](*inputs)
        ref32 = None  # below float32, the float32 model is the truth (benchmarks.run.check)
        if dtype != torch.float32:
            model32, inputs32 = make(name, SIZES[args.size], device, torch.float32)
            ref32 = _main_output(model32(*inputs32))
            del model32
        for variant, backend in (("inductor", "inductor"), ("ours", "egraph")):
            torch._dynamo.reset()
            egc.last_plans(clear=True)
            compiled = torch.compile(model, backend=backend, mode=args.mode)
            try:
                sync(device)
                t0 = time.perf_counter()
                out = _main_output(compiled(*inputs))
                sync(device)
                row["compile_s"][variant] = time.perf_counter() - t0
                bad = check(out, ref, TOL[dtype], ref32)
                row["status"][variant] = bad or "ok"
                if bad is None:
                    callables[variant] = lambda *a, c=compiled: _main_output(c(*a))
            except Exception as exc:  # report, don't stop the other models
                row["status"][variant] = "error: " + short_error(exc)
            if variant == "ours":
                kernels = [k for p in egc.last_plans() for k in p.kernels]
                row["kernels"] = {kind: sum(k.kind == kind for k in kernels) for kind in ("generated", "library",
                                                                                           "aten")}
                row["fallbacks"] = sorted({f.split(" ")[0] for p in egc.last_plans() for f in p.fallbacks})
                row["estimated_ms"] = sum(p.cost for p in egc.last_plans()) * 1e3  # the cost model's, beside the clock
        for f in callables.values():  # warm-up
            for _ in range(3):
                f(*inputs)
        inner = {v: max(1, int(0.05 / max(min(time_block(f, inputs, 1, device) for _ in range(3)), 1e-6)))
                 for v, f in callables.items()}
        row["ms"] = interleaved(lambda v: 1e3 * time_block(callables[v], inputs, min(inner[v], 200), device),
                                list(callables), args.reps)
        if args.profile:
            row["profile"] = {v: profile(f, inputs, args.profile, device) for v, f in callables.items()}
    torch._dynamo.reset()
    return row


def profile(fn, inputs, top: int, device: str, calls: int = 5) -> list[tuple[str, int, float]]:
    """Where one call's time goes: the `top` kernels (CPU: ops) by self time, as
    (name, launches per call, microseconds per call), from benchmarks.kernels."""
    return [(key[:90], count, us) for key, us, count in kernel_times(fn, inputs, calls, device)[:top]]


def markdown(rows: list[dict]) -> str:
    head = ("| model | eager ms | inductor ms | ours ms | ours estimated ms | ours/inductor | ours/eager | ours kernels "
            "(gen/lib/aten) | ATen fallbacks | compile s (inductor, ours) |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ms, c = r["ms"], r["compile_s"]
        ratio = (lambda a, b: f"{a / b:.2f}x" if a and b else r["status"].get("ours", "-"))
        k = r.get("kernels", {})
        lines.append(f"| {r['model']} | {ms.get('eager', 0):.3f} | {ms.get('inductor', 0):.3f} | "
                     f"{ms.get('ours', 0):.3f} | {r.get('estimated_ms') or 0:.3f} | {ratio(ms.get('inductor'), ms.get('ours'))} | "
                     f"{ratio(ms.get('eager'), ms.get('ours'))} | {k.get('generated', 0)}/{k.get('library', 0)}/"
                     f"{k.get('aten', 0)} | {', '.join(f.removeprefix('aten.') for f in r.get('fallbacks', []))} | "
                     f"{c.get('inductor', 0):.1f}, {c.get('ours', 0):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = model_parser(__doc__, ",".join(MODELS), reps=11)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list each variant's N costliest kernels per call (torch.profiler; in --json)")
    args = parser.parse_args(argv)
    return run_models("models", args, bench_model, markdown, f"inference, mode {args.mode}")


if __name__ == "__main__":
    sys.exit(main())
