"""Compiled models under torch.distributed (issue 12): two processes on CPU with
the gloo backend, started by the test.  `DDP(torch.compile(model,
backend="egraph"))` compiles each rank's forward and backward graphs through
the pipeline, and after a few optimizer steps its parameters match eager DDP's
(an MLP and GPT-2; LLaMA with grouped-query attention goes through FSDP2, each model
through one of the two, to keep the suite's time: each test starts two processes).
`torch.compile(DDP(model), backend="egraph")`: Dynamo skips DDP's forward (as it
does for Inductor in torch 2.13), so the model runs eagerly and the backend is
never called; the README says to wrap the compiled model in DDP instead.
FSDP2 (`fully_shard` per block and the root, then torch.compile) compiles each
block between FSDP's hooks and matches eager FSDP2."""
import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2


class Block(torch.nn.Module):
    """A residual MLP block: FSDP2 shards per block, as users shard transformer layers."""
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _blocks(model) -> list:
    """The modules FSDP2 shards one by one (then the root)."""
    if isinstance(model, torch.nn.Sequential):
        return [m for m in model if isinstance(m, Block)]
    inner = getattr(model, "transformer", None) or model.model
    return list(inner.h if hasattr(inner, "h") else inner.layers)


def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "blocks":
        return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(32, 8))
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                   torch.nn.Linear(64, 8))
    import transformers as tf
    if name == "llama_gqa":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  use_cache=False)).train()
    config = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, use_cache=False,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(config).train()


def _batch(name: str, g: torch.Generator):
    return torch.randn(16, 32, generator=g) if name in ("mlp", "blocks") else torch.randint(0, 128, (2, 16), generator=g)


def _loss(model, x):
    out = model(x)
    return (out.logits if hasattr(out, "logits") else out).square().mean()


def _rank(rank: int, init: str, name: str, order: str, results) -> None:
    import warnings
    warnings.simplefilter("ignore")
    import egraph_compiler as egc
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        model = _model(name)
        reference = copy.deepcopy(model)
        egc.last_plans(clear=True)
        if order == "fsdp2":  # fully_shard per block and the root, then torch.compile
            ours, eager = torch.compile(_fsdp2(model), backend="egraph"), _fsdp2(reference)
        else:
            ours = (DDP(torch.compile(model, backend="egraph")) if order == "ddp_of_compiled"
                    else torch.compile(DDP(model), backend="egraph"))
            eager = DDP(reference)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, eager)]
        g = torch.Generator().manual_seed(rank)  # each rank its own data: the gradients are all-reduced
        for _ in range(3):
            x = _batch(name, g)
            for m, opt in zip((ours, eager), optimizers):
                opt.zero_grad()
                _loss(m, x).backward()
                opt.step()
        def full(p):
            return p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's parameters are sharded DTensors
        scale = max(full(p).abs().max().item() for p in reference.parameters())
        diff = max((full(a) - full(b)).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        plans = egc.last_plans()
        # plans that compute a block's matmuls (forward or backward), not just glue between hooks (blocks of one class
        # share their compiled graphs: parameters are graph inputs)
        blocks = sum(1 for p in plans if p.count("matmul") + p.count("linear") >= 2)
        results[rank] = (diff / scale, len(plans) if order != "fsdp2" else blocks)
    finally:
        dist.destroy_process_group()


def _run(name: str, order: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(f"file://{tmp}/rendezvous", name, order, results), nprocs=WORLD)
        return dict(results)


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_ddp_of_a_compiled_model_matches_eager_ddp(name):
    results = _run(name, "ddp_of_compiled")
    assert sorted(results) == list(range(WORLD))
    for rank, (relative_diff, plans) in results.items():
        assert plans >= 2, f"rank {rank}: the pipeline compiled {plans} plan(s), expected forward and backward"
        assert relative_diff < 1e-3, f"rank {rank}: parameters differ from eager DDP's by {relative_diff:.2e}"


@pytest.mark.parametrize("name", ["blocks", "llama_gqa"])
def test_fsdp2_sharded_model_compiled_matches_eager_fsdp2(name):
    """fully_shard per block, then torch.compile(model, backend="egraph"): Dynamo breaks
    the graph at FSDP's hooks (which gather and free parameters) and compiles each
    block's forward between them; AOTAutograd compiles their backward."""
    results = _run(name, "fsdp2")
    assert sorted(results) == list(range(WORLD))
    for rank, (relative_diff, plans) in results.items():
        assert plans >= 2, f"rank {rank}: the pipeline compiled {plans} block plan(s) under FSDP2, expected a forward and a backward"
        assert relative_diff < 1e-3, f"rank {rank}: parameters differ from eager FSDP2's by {relative_diff:.2e}"


def test_compiling_ddp_itself_runs_eagerly_as_dynamo_skips_ddp():
    results = _run("mlp", "compiled_ddp")
    assert all(plans == 0 and diff == 0.0 for diff, plans in results.values()), results


def _collectives_rank(rank: int, init: str, results) -> None:
    import warnings
    import torch.distributed._functional_collectives as funcol
    import egraph_compiler as egc
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        def program(x, w):
            y = funcol.all_reduce(torch.relu(x @ w), "sum", dist.group.WORLD)
            z = funcol.all_gather_tensor(y * 2, 0, dist.group.WORLD)
            r = funcol.reduce_scatter_tensor(z.exp(), "sum", 0, dist.group.WORLD)
            return y * 2 + 1, z.sum(0), r - 1
        torch.manual_seed(rank)
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        egc.last_plans(clear=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: collectives are ops of the vocabulary
            got = torch.compile(program, backend="egraph")(x, w)
        want = program(x, w)
        plan = egc.last_plans()[-1]
        calls = [(k.output.op, k.kind, k.seconds) for k in plan.kernels if k.output.group == "collective"]
        link = [k.bytes / plan.profile.link_bandwidth + plan.profile.launch for k in plan.kernels
                if k.output.group == "collective"]
        results[rank] = ([((a - b).abs() / (b.abs() + 1e-6)).max().item() for a, b in zip(got, want)],
                         calls, link, plan.fallbacks)
    finally:
        dist.destroy_process_group()


def test_functional_collectives_are_library_calls_of_the_plan():
    """all_reduce, all_gather, reduce_scatter and their waits inside a captured graph:
    library kernels of the plan (no ATen fallback, no warning), charged their bytes over
    the link, nothing fused across them, results as eager's on both ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_collectives_rank, args=(f"file://{tmp}/rendezvous", results), nprocs=WORLD)
        results = dict(results)
    assert sorted(results) == list(range(WORLD))
    for rank, (errors, calls, link, fallbacks) in results.items():
        assert max(errors) < 1e-5, (rank, errors)
        assert fallbacks == []
        assert [op for op, _, _ in calls] == ["all_reduce", "wait_tensor", "all_gather", "wait_tensor",
                                              "reduce_scatter", "wait_tensor"]
        assert all(kind == "library" for _, kind, _ in calls)
        assert [s for _, _, s in calls] == pytest.approx(link)
