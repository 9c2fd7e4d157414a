"""Training steps through torch.compile: eager vs Inductor vs egraph-compiler.

    python -m benchmarks.training [--size test|cpu|gpu] [--device cpu|cuda]
                                  [--dtype float32|bfloat16] [--models gpt2,llama_gqa,bert,vit]
                                  [--reps N] [--mode reduce-overhead] [--json PATH]

One step is forward, loss, backward and an AdamW update of a small random-weight
`transformers` model in train mode with dropout off (benchmarks.models' configs).
Each variant trains its own copy of the same initial weights; the compiled
variants' first-step gradients are checked against eager's before any timing.
The optimizer is eager for all three (only the model is compiled).  Timing: the
variants interleaved per round, a block of steps per round, medians of the rounds.
"""
from __future__ import annotations

import copy
import sys
import time
import traceback

import torch

import egraph_compiler as egc
from benchmarks.common import interleaved, model_parser, run_models
from benchmarks.models import SIZES, make
from benchmarks.run import short_error
from benchmarks.timing import sync


def _loss(model, inputs) -> torch.Tensor:
    out = model(*inputs)
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return main.float().square().mean()


def _no_dropout(model) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for key in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)


def _grads_differ(got: torch.nn.Module, want: torch.nn.Module, tol: float) -> str | None:
    pairs = [(n, a.grad, b.grad) for (n, a), b in zip(got.named_parameters(), want.parameters()) if b.grad is not None]
    scale = max(b.abs().max().item() for _, _, b in pairs)
    for name, a, b in pairs:
        if a is None or (a.float() - b.float()).abs().max().item() > tol * scale:
            return f"gradient of {name} differs"
    return None


def bench_model(name: str, args) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    base, inputs = make(name, SIZES[args.size], device, dtype)
    base.train()
    _no_dropout(base)
    row: dict = {"model": name, "status": {}, "compile_s": {}, "ms": {}}
    models = {v: copy.deepcopy(base) for v in ("eager", "inductor", "ours")}
    fns = {v: m if v == "eager" else torch.compile(m, backend="egraph" if v == "ours" else "inductor", mode=args.mode)
           for v, m in models.items()}
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    torch._dynamo.reset()
    for variant, model in models.items():  # first step: compile, then gradients against eager's
        egc.last_plans(clear=True)
        try:
            sync(device)
            t0 = time.perf_counter()
            _loss(fns[variant], inputs).backward()
            sync(device)
            row["compile_s"][variant] = time.perf_counter() - t0
            bad = None if variant == "eager" else _grads_differ(model, models["eager"], tol)
            row["status"][variant] = bad or "ok"
        except Exception as exc:  # report, don't stop the other models
            row["status"][variant] = "error: " + short_error(exc)
            traceback.print_exc()
        if variant == "ours":
            row["fallbacks"] = sorted({f.split(" ")[0] for p in egc.last_plans() for f in p.fallbacks})
            row["kernels"] = sum(len(p.kernels) for p in egc.last_plans())
    steps = {}
    for variant, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(fn=fns[variant], opt=opt):
            opt.zero_grad(set_to_none=True)
            _loss(fn, inputs).backward()
            opt.step()
        steps[variant] = step
    runnable = {v: s for v, s in steps.items() if row["status"].get(v) == "ok"}
    for s in runnable.values():  # warm-up (and the compiles of torch.compile's own wrappers)
        for _ in range(3):
            s()
    sync(device)

    def measure(v: str) -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.block):
            runnable[v]()
        sync(device)
        return 1e3 * (time.perf_counter() - t0) / args.block
    row["ms"] = interleaved(measure, list(runnable), args.reps)
    torch._dynamo.reset()
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | eager ms/step | inductor ms/step | ours ms/step | ours/inductor | ours/eager | ours kernels "
             "(fw+bw) | ATen fallbacks | first step s (inductor, ours) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, c = r["ms"], r["compile_s"]
        ratio = (lambda a, b: f"{a / b:.2f}x" if a and b else r["status"].get("ours", "-"))
        lines.append(f"| {r['model']} | {ms.get('eager', 0):.2f} | {ms.get('inductor', 0):.2f} | {ms.get('ours', 0):.2f} "
                     f"| {ratio(ms.get('inductor'), ms.get('ours'))} | {ratio(ms.get('eager'), ms.get('ours'))} | "
                     f"{r.get('kernels', 0)} | {', '.join(f.removeprefix('aten.') for f in r.get('fallbacks', []))} "
                     f"| {c.get('inductor', 0):.1f}, {c.get('ours', 0):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = model_parser(__doc__, "gpt2", reps=7)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args(argv)
    return run_models("training", args, bench_model, markdown, f"training step, mode {args.mode}")


if __name__ == "__main__":
    sys.exit(main())
