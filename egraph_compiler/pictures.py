"""Pictures of a compile, drawn by Graphviz (the `graphviz` package, which runs
the system's `dot` program: Debian's `graphviz` package).

- `plan_dot`: the plan's kernels as boxes coloured by kind (generated / library /
  ATen fallback), program inputs and outputs, edges labelled with the tensor's
  shape and bytes.  Each box's SVG group has the id `kernel_NAME`, which the HTML
  report's script makes clickable.
- `graph_dot`: a Graph IR dataflow graph (the captured one, or the extracted
  one with the nodes that rules introduced highlighted).
- `egraph_dot`: a bounded view of the saturated e-graph around one e-class:
  e-classes as clusters of their e-nodes, out to a radius of operand edges.

This is the one module that imports graphviz.
"""
from __future__ import annotations

from pathlib import Path

import graphviz

from .errors import EgraphCompilerError
from .graph import Graph, Node, format_attr, topo_order, type_str, view_source

COLOURS = {"generated": "#c8ecc8", "library": "#c6dcf5", "aten": "#f6c4c0"}
NEW_NODE = "#ffe9a8"  # a node that rules introduced (not in the captured graph)
DOT_MISSING = ("Graphviz's `dot` program is not installed (the pictures need it): on Debian, "
               "`apt-get install graphviz`")


def svg(dot: graphviz.Digraph) -> str:
    """The picture as SVG text (no XML prologue, ready to inline in HTML)."""
    try:
        text = dot.pipe(format="svg", encoding="utf-8")
    except graphviz.ExecutableNotFound:
        raise EgraphCompilerError(DOT_MISSING) from None
    start = text.find("<svg")
    return text[start:] if start >= 0 else text


def write_svg(dot: graphviz.Digraph, path: Path) -> Path:
    path.write_text(svg(dot))
    return path


def _size(node: Node) -> str:
    from .cost import itemsize
    n = node.numel * itemsize(node.dtype)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def plan_dot(plan) -> graphviz.Digraph:
    dot = graphviz.Digraph("plan", graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "10"},
                           node_attr={"fontname": "Helvetica", "fontsize": "10"},
                           edge_attr={"fontname": "Helvetica", "fontsize": "9", "color": "#555555"})
    producer: dict[int, str] = {}
    for i, node in enumerate(plan.graph.inputs):
        name = f"input-{i}"
        dot.node(name, f"{node.attr('name')}\n{type_str(node)}", shape="ellipse", style="filled",
                 fillcolor="#eeeeee", id=name)
        producer[id(node)] = name
    for kernel in plan.kernels:
        producer[id(kernel.output)] = kernel.name
        ops_text = " \u2192 ".join(n.op for n in kernel.ops if n.group not in ("boundary", "source", "layout"))
        if len(ops_text) > 48:
            ops_text = ops_text[:45] + "..."
        label = f"{kernel.name} ({kernel.kind})\n{ops_text or kernel.output.op}\n{type_str(kernel.output)}  " \
                f"est {kernel.seconds * 1e6:.1f} us"
        dot.node(kernel.name, label, shape="box", style="filled,rounded", fillcolor=COLOURS[kernel.kind],
                 id=f"kernel_{kernel.name}", tooltip=f"{kernel.name}: click for its ops, loop IR and source")
        for source in kernel.inputs:
            origin = producer.get(id(view_source(source)))
            if origin is not None:
                dot.edge(origin, kernel.name, label=f"{type_str(source)}\n{_size(source)}")
    for i, out in enumerate(plan.graph.outputs):
        name = f"output-{i}"
        dot.node(name, f"output {i}\n{type_str(out)}", shape="ellipse", style="filled", fillcolor="#eeeeee",
                 id=name)
        origin = producer.get(id(view_source(out)))
        if origin is not None:
            dot.edge(origin, name, label=_size(out))
    return dot


def graph_dot(graph: Graph, name: str, introduced: dict[int, list[str]] | None = None) -> graphviz.Digraph:
    """`introduced`: id(node) -> the rules that may have built it (highlighted)."""
    introduced = introduced or {}
    dot = graphviz.Digraph(name, graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "10"},
                           node_attr={"fontname": "Helvetica", "fontsize": "9", "shape": "box",
                                      "style": "filled,rounded", "fillcolor": "#ffffff"},
                           edge_attr={"color": "#777777", "arrowsize": "0.6"})
    ids: dict[int, str] = {}
    for node in topo_order(graph.outputs):
        if node.op == "const":
            continue
        ids[id(node)] = key = f"{name}-n{len(ids)}"
        if node.op == "input":
            dot.node(key, f"{node.attr('name')}\n{type_str(node)}", shape="ellipse", fillcolor="#eeeeee")
            continue
        attrs = ", ".join(f"{k}={format_attr(v)}" for k, v in node.attrs if k != "target")
        label = (str(node.attr("target")).split("#")[0] if node.op == "extern" else node.op)
        label += (f"({attrs})" if attrs and len(attrs) < 40 else "") + f"\n{type_str(node)}"
        rules = introduced.get(id(node))
        extra = dict(fillcolor=NEW_NODE, tooltip="introduced by rules; candidates: " + ", ".join(rules)) \
            if rules is not None else dict(tooltip=graph.where.get(id(node), ""))
        dot.node(key, label, **extra)
        for a in node.args:
            if id(a) in ids:
                dot.edge(ids[id(a)], key)
    return dot


def egraph_dot(eclasses, center: str, radius: int = 2, limit: int = 40) -> graphviz.Digraph:
    """The e-classes within `radius` operand edges of `center` (at most `limit`),
    each a cluster of its e-nodes; an edge runs from an e-node to the class it reads."""
    users: dict[str, set[str]] = {}
    for class_id, enodes in eclasses.classes.items():
        for en in enodes:
            for child in en.children:
                users.setdefault(child, set()).add(class_id)
    near, frontier = [center], [center]
    for _ in range(radius):
        step = []
        for c in frontier:
            for other in [ch for en in eclasses.classes.get(c, []) for ch in en.children] + sorted(users.get(c, ())):
                if other not in near and len(near) < limit:
                    near.append(other)
                    step.append(other)
        frontier = step
    dot = graphviz.Digraph("egraph", graph_attr={"compound": "true", "fontname": "Helvetica", "fontsize": "10"},
                           node_attr={"fontname": "Helvetica", "fontsize": "9", "shape": "box",
                                      "style": "rounded"})
    first: dict[str, str] = {}
    for c in near:
        with dot.subgraph(name=f"cluster_{c}") as sub:
            shape = eclasses.shape.get(c)
            title = f"e-class {c}" + (f"  {eclasses.dtype.get(c, '')}{list(shape)}" if shape is not None else "")
            sub.attr(label=title, style="filled", fillcolor="#f3f0ff" if c == center else "#f7f7f7",
                     color="#8877cc" if c == center else "#bbbbbb")
            for j, en in enumerate(eclasses.classes.get(c, [])):
                key = f"{c}.{j}"
                first.setdefault(c, key)
                attrs = ", ".join(f"{k}={format_attr(v)}" for k, v in en.attrs.items() if k != "target")
                label = str(en.attrs["target"]).split("#")[0] if en.op == "extern" else en.op
                sub.node(key, label + (f"({attrs})" if attrs and len(attrs) < 32 else ""))
    for c in near:
        for j, en in enumerate(eclasses.classes.get(c, [])):
            for child in en.children:
                if child in first:
                    dot.edge(f"{c}.{j}", first[child], lhead=f"cluster_{child}", arrowsize="0.6")
    return dot
