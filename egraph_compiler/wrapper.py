"""The straight-line Python a compiled program runs per call (as Inductor's wrapper code):
one line per kernel launch, allocation and release, made once per program from its plan
(runtime.Executable), so that no call interprets the plan."""
from __future__ import annotations

from dataclasses import dataclass, field

from .steps import empty, torch_dtype


@dataclass
class Wrapper:
    """A program's wrapper: `source` prints; `names` are its globals."""
    source: str
    names: dict = field(default_factory=dict)


def straight_line(executable, loops_by_name: dict, nodes: dict, release) -> Wrapper:
    """The wrapper of an Executable: its generated kernels' calls (`loops_by_name`: their loop
    IR; `nodes`: buffer name -> node) and torch steps, with each value released where
    `release` (plan.release_schedule) says."""
    plan, target = executable.plan, executable.target
    local: dict[int, str] = {}
    names: dict = {}
    lines = ["def run(env):"]
    generated_reads = {id(i) for k in plan.kernels if k.kind == "generated" for i in k.inputs}
    for i, node in enumerate(plan.graph.inputs):
        local[id(node)] = f"a{i}"
        lines.append(f"    a{i} = env[{id(node)}]")
    for step, kernel in enumerate(plan.kernels):
        if kernel.kind == "generated" and kernel.loop_nest:
            pass  # computed by its sibling's loop nest
        elif kernel.kind == "generated":
            loop = loops_by_name[kernel.name]
            ins = [local[id(nodes[p.name])] for p in loop.params if p.role == "in"]
            outs = []
            for p in loop.params:
                if p.role == "out":
                    node = nodes[p.name]
                    outs.append(p.name)
                    local[id(node)] = p.name
                    names[f"_empty_{p.name}"] = empty(node.shape, torch_dtype(node.dtype), target.device)
                    lines.append(f"    {p.name} = _empty_{p.name}()")
            names[f"_{kernel.name}"] = executable._calls[kernel.name]
            lines.append(f"    _{kernel.name}({', '.join(ins + outs)})  # {kernel.output.op}")
        else:
            local[id(kernel.output)] = f"t{step}"
            names[f"_{kernel.name}"] = executable.torch_step(kernel, id(kernel.output) in generated_reads)
            args = ", ".join(local[id(i)] for i in kernel.inputs)
            lines.append(f"    t{step} = _{kernel.name}({args})  # {kernel.kind}: {kernel.output.op}")
        dead = [local[id(n)] for n in release[step]]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    released = {id(n) for step in release for n in step}
    live = [(key, name) for key, name in local.items() if key not in released]
    lines.append("    return {" + ", ".join(f"{key}: {name}" for key, name in live) + "}")
    return Wrapper("\n".join(lines), names)


def exec_wrapper(source: str, names: dict):
    scope = dict(names)
    exec(compile(source, "<egraph-compiler wrapper>", "exec"), scope)
    return scope["run"]
