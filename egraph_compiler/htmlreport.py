"""One self-contained HTML page per compile: what the e-graph found, what
extraction chose and why, and what code came out.  No network is needed to
view it: the pictures are inline SVG (pictures.py), the style and the script
are in the page.

- the plan as a graph, kernels coloured by kind; clicking a kernel shows its
  ops, loop IR, source and estimated cost against the roofline (and its
  measured time when the compile was measured);
- the captured graph beside the extracted one, the nodes rules introduced
  highlighted with the rules that build such a node and fired;
- the saturation report: phases, per-rule matches, a chart of e-node growth;
- a bounded view of the e-graph around one e-class;
- ATen fallbacks with the user's source line; every IR level's text.

`write_report(path, compiled)` writes one page; `report_dir_page(dir, compiled)`
adds a page to a directory and rewrites its `index.html` (what the EGC_REPORT
environment variable does for every compile).
"""
from __future__ import annotations

import html
import re
from pathlib import Path

from . import pictures
from .cost import peak_flops
from .dsl.parser import FuseRule
from .dsl.terms import Pat
from .graph import topo_order, type_str

def _e(text) -> str:
    return html.escape(str(text))


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f} us"


def introduced_nodes(plan, captured, rules, fired: dict) -> dict[int, list[str]]:
    """id(node) -> the fired rules that may have built it, for each extracted
    node the captured graph does not have: compared by structure (op, attributes,
    operands), seeing through `inline` marks, so an op whose operand was only
    fused is not new; the `inline` marks themselves name the fuse rules that fit."""
    def keys(nodes) -> dict[int, tuple]:
        memo: dict[int, tuple] = {}
        for n in nodes:
            inner = [a.args[0] if a.op == "inline" else a for a in n.args]
            memo[id(n)] = (n.op, n.attrs, n.shape, n.dtype, tuple(memo.get(id(a), id(a)) for a in inner))
        return memo
    original = set(keys(topo_order(captured.outputs)).values())
    order = topo_order(plan.graph.outputs)
    built = keys(order)
    users: dict[int, list] = {}
    for n in order:
        for a in n.args:
            users.setdefault(id(a), []).append(n)
    builds: dict[str, set[str]] = {}  # op -> rules whose built side has it at its root (else anywhere)
    inside: dict[str, set[str]] = {}
    fusers = [r for r in rules if isinstance(r, FuseRule) and fired.get(r.name)]
    for rule in rules:
        if isinstance(rule, FuseRule) or not fired.get(rule.name):
            continue
        for side in [rule.rhs] + ([rule.lhs] if rule.both_ways else []):
            if isinstance(side, Pat):
                builds.setdefault(side.op, set()).add(rule.name)
            for op in _pattern_ops(side):
                inside.setdefault(op, set()).add(rule.name)
    out = {}
    for node in order:
        if node.group == "source" or (node.op != "inline" and built[id(node)] in original):
            continue
        if node.op == "inline":
            inner = node.args[0]
            outer = users.get(id(node), [])
            names = [r.name for r in fusers if _names(inner, r.producers)
                     and any(_names(u, r.consumers) for u in outer)]
        else:
            names = sorted(builds.get(node.op) or inside.get(node.op, ()))
        out[id(node)] = names or ["(none that fired builds this op)"]
    return out


def _names(node, names) -> bool:
    """The op or its group is one of a fuse rule's names."""
    from . import ops
    return node.op in names or ops.group_of(node.op) in names


def _pattern_ops(term) -> set[str]:
    if isinstance(term, Pat):
        return {term.op}.union(*(_pattern_ops(a) for a in term.args))
    return set()


def _kernel_detail(kernel, loop_text: str, source: str, profile, measured: float | None, where: str) -> str:
    link = kernel.output.group == "collective"  # bytes over the link between processes
    memory = kernel.bytes / (profile.link_bandwidth if link else profile.bandwidth)
    peak = peak_flops(profile, kernel.kind == "library", kernel.output.op)
    compute = kernel.flops / peak
    bound = "link" if link else "memory" if memory >= compute else "compute"
    rows = [("kind", kernel.kind + (f" (fallback: {kernel.reason})" if kernel.reason else "")),
            ("computes", " \u2192 ".join(n.op for n in kernel.ops if n.group != "boundary")),
            ("output", type_str(kernel.output)),
            ("reads", ", ".join(type_str(i) for i in kernel.inputs) or "nothing"),
            ("source line", where or "(none recorded)"),
            ("bytes moved", f"{kernel.bytes:,.0f}"), ("flops", f"{kernel.flops:,.0f}"),
            ("roofline", f"{_us(max(memory, compute))} ({bound}-bound: {'link' if link else 'memory'} {_us(memory)}, "
                         f"compute {_us(compute)} at {peak / 1e9:.0f} GFLOP/s)"),
            ("estimate", f"{_us(kernel.seconds)} (roofline + launch {_us(profile.launch)})"),
            ("measured", _us(measured) if measured is not None else "not measured (egc explain --measure)")]
    if kernel.loop_nest:
        rows.append(("loop nest", f"computed in {kernel.loop_nest}'s loop nest (horizontal fusion)"))
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    code = (f"<h4>loop IR</h4><pre class='code'>{_e(loop_text)}</pre><h4>source</h4>"
            f"<pre class='code source'>{_e(source)}</pre>") if source else \
        f"<h4>source</h4><pre class='code source'>{_e(_call_text(kernel))}</pre>"
    return (f"<section class='kernel-detail' id='detail-{kernel.name}' hidden><h3>{kernel.name}</h3>"
            f"<table class='facts'>{table}</table>{code}</section>")


def _call_text(kernel) -> str:
    node = kernel.output
    attrs = ", ".join(f"{k}={v}" for k, v in node.attrs if k != "target")
    name = str(node.attr("target")).split("#")[0] if node.op == "extern" else node.op
    what = "an ATen fallback" if kernel.kind == "aten" else "a library call"
    return f"# {what}, no generated source\n{name}({', '.join(type_str(i) for i in kernel.inputs)}" + \
        (f", {attrs}" if attrs else "") + f") -> {type_str(node)}"


def _growth_chart(growth: list[tuple[int, float]]) -> str:
    """A small line chart of e-nodes after each iteration (inline SVG)."""
    if not growth:
        return "<p>no iterations ran</p>"
    w, h, pad = 420, 140, 30
    top = max(n for n, _ in growth) or 1
    step = (w - 2 * pad) / max(len(growth) - 1, 1)
    points = " ".join(f"{pad + i * step:.1f},{h - pad - (n / top) * (h - 2 * pad):.1f}" for i, (n, _) in
                      enumerate(growth))
    dots = "".join(f"<circle cx='{pad + i * step:.1f}' cy='{h - pad - (n / top) * (h - 2 * pad):.1f}' r='2.5'>"
                   f"<title>iteration {i + 1}: {n} e-nodes at {s:.3f} s</title></circle>"
                   for i, (n, s) in enumerate(growth))
    return (f"<svg class='chart' width='{w}' height='{h}' viewBox='0 0 {w} {h}' role='img' "
            f"aria-label='e-nodes per iteration'>"
            f"<line x1='{pad}' y1='{h - pad}' x2='{w - pad}' y2='{h - pad}' stroke='#999'/>"
            f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{h - pad}' stroke='#999'/>"
            f"<text x='{pad}' y='{pad - 8}' font-size='10'>{top} e-nodes</text>"
            f"<text x='{w - pad}' y='{h - 8}' font-size='10' text-anchor='end'>iteration {len(growth)}</text>"
            f"<polyline fill='none' stroke='#5b4bb7' stroke-width='2' points='{points}'/>{dots}</svg>")


def _saturation(report) -> str:
    phases = "".join(f"<tr><td>{_e(g)}</td><td>{_e(r)}</td><td>{c}</td><td>{b} \u2192 {a}</td><td>{s:.3f} s</td></tr>"
                     for g, r, c, b, a, s in report.phases)
    matches = "".join(f"<tr><td>{_e(name)}</td><td>{n}</td></tr>"
                      for name, n in sorted(report.matches.items(), key=lambda kv: -kv[1]) if n)
    return (f"<p>{_e(report.stop_reason)} after {report.iterations} iteration(s), {report.enodes} e-nodes, "
            f"{report.seconds:.3f} s{_e(' (' + report.note + ')') if report.note else ''}</p>"
            f"<div class='row'><div>{_growth_chart(report.growth)}</div>"
            f"<table class='grid'><tr><th>phase (groups)</th><th>stopped</th><th>iterations</th><th>e-nodes</th>"
            f"<th>time</th></tr>{phases}</table></div>"
            f"<details><summary>rule matches ({sum(1 for n in report.matches.values() if n)} rules fired)</summary>"
            f"<table class='grid'><tr><th>rule</th><th>matches</th></tr>{matches}</table></details>")


def render(compiled, measured: dict[str, float] | None = None, title: str = "", eclass: str | None = None) -> str:
    """The page's HTML for a CompiledFunction compiled with `report=` (or keep_egraph)."""
    plan, levels, report = compiled.plan, compiled.levels, compiled.report
    profile = plan.profile
    loops = {lk.name: lk for lk in compiled.loop_kernels}
    target = compiled._executable.target
    kinds = {k: sum(1 for x in plan.kernels if x.kind == k) for k in ("generated", "library", "aten")}
    measured = measured or {}
    details = []
    for kernel in plan.kernels:
        lk = loops.get(kernel.name)
        source = target.kernel_source(lk) if lk is not None and target.kernel_source else ""
        where = plan.graph.where.get(id(kernel.output), "")
        details.append(_kernel_detail(kernel, str(lk) if lk is not None else "", source, profile,
                                      measured.get(kernel.name), where))
    fallbacks = "".join(f"<li>{_e(f)}</li>" for f in plan.fallbacks)
    fallback_box = (f"<div class='fallbacks'><strong>{len(plan.fallbacks)} ATen fallback(s)</strong> (op, why, "
                    f"your source line):<ul>{fallbacks}</ul></div>") if plan.fallbacks else ""
    introduced = introduced_nodes(plan, levels.captured, levels.rules, report.matches) if levels.captured else {}
    rewrites = "".join(f"<li><code>{_e(n.op)}</code> {_e(type_str(n))}: {_e(', '.join(r))}</li>"
                       for n in topo_order(plan.graph.outputs) if id(n) in introduced
                       for r in [introduced[id(n)]])
    center = eclass or _default_eclass(plan, levels.eclasses)
    egraph_view = ""
    if levels.eclasses is not None and center in levels.eclasses.classes:
        egraph_view = (f"<section><h2>The e-graph around e-class {_e(center)}</h2><p>e-classes within two operand "
                       f"edges (at most 40); each box lists the equivalent e-nodes of one class. "
                       f"<code>egc explain --eclass ID</code> chooses another.</p>"
                       f"<div class='picture'>{pictures.svg(pictures.egraph_dot(levels.eclasses, center))}</div>"
                       f"</section>")
    texts = "".join(f"<details><summary>{_e(name)}</summary><pre class='code'>{_e(text)}</pre></details>"
                    for name, text in [("ATen graph", levels.aten), ("Graph IR", levels.graph),
                                       ("plan", levels.plan), ("loop IR", levels.loops),
                                       ("source", levels.source), ("wrapper", levels.wrapper)])
    total_measured = sum(measured.values()) if measured else None
    summary = (f"target <b>{_e(target.name)}</b> ({_e(target.language)}) · {len(plan.kernels)} kernel(s): "
               f"{kinds['generated']} generated, {kinds['library']} library, {kinds['aten']} ATen · estimated "
               f"{_us(plan.cost)}" + (f" · measured {_us(total_measured)}" if total_measured else "") +
               f" · profile {_e(profile.name)} · " + ", ".join(f"{k} {v:.2f} s" for k, v in levels.timings.items()))
    captured_svg = pictures.svg(pictures.graph_dot(levels.captured, "captured")) if levels.captured else ""
    extracted_svg = pictures.svg(pictures.graph_dot(plan.graph, "extracted", introduced))
    return PAGE.format(
        title=_e(title or "egraph-compiler report"), style=STYLE, script=SCRIPT, summary=summary,
        fallbacks=fallback_box, plan_svg=pictures.svg(pictures.plan_dot(plan)), details="".join(details),
        legend=_legend(), captured=captured_svg, extracted=extracted_svg,
        rewrites=rewrites or "<li>none: the extracted graph is the captured one</li>",
        extraction=_e(plan.extraction), saturation=_saturation(report), egraph=egraph_view, texts=texts,
        kernel_rows="".join(_kernel_row(k, measured.get(k.name)) for k in plan.kernels))


def _kernel_row(kernel, measured) -> str:
    return (f"<tr class='kernel-row' data-kernel='{kernel.name}'><td>{kernel.name}</td><td class='{kernel.kind}'>"
            f"{kernel.kind}</td><td>{_e(type_str(kernel.output))}</td><td>{_e(f'{kernel.bytes:,.0f}')}</td>"
            f"<td>{_us(kernel.seconds)}</td><td>{_us(measured)}</td></tr>")


def _legend() -> str:
    return "".join(f"<span class='swatch' style='background:{c}'></span>{k} " for k, c in pictures.COLOURS.items())


def _default_eclass(plan, eclasses) -> str | None:
    """The e-class of the costliest kernel's output (else the first output's)."""
    if eclasses is None:
        return None
    for kernel in sorted(plan.kernels, key=lambda k: -k.seconds):
        found = plan.graph.eclass.get(id(kernel.output))
        if found in eclasses.classes:
            return found
    return eclasses.roots[0] if eclasses.roots else None


def write_report(path, compiled, measured=None, title: str = "", eclass: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(compiled, measured, title or path.stem, eclass))
    return path


def report_dir_page(directory, compiled, name: str) -> Path:
    """Adds a page for this compile to `directory` and rewrites its index.html."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    number = len(list(directory.glob("graph*.html")))
    page = write_report(directory / f"graph{number:03d}.html", compiled, title=f"{name} (graph {number})")
    write_index(directory)
    return page


def write_index(directory: Path) -> Path:
    rows = []
    for page in sorted(directory.glob("graph*.html")):
        text = page.read_text()
        title = re.search(r"<title>(.*?)</title>", text)
        summary = re.search(r"<p class='summary'>(.*?)</p>", text, re.S)
        rows.append(f"<li><a href='{_e(page.name)}'>{title.group(1) if title else page.name}</a>"
                    f"<br><small>{summary.group(1) if summary else ''}</small></li>")
    index = directory / "index.html"
    index.write_text(INDEX.format(style=STYLE, rows="".join(rows)))
    return index


def write_svgs(directory, compiled) -> list[Path]:
    """The pictures alone: plan.svg, captured.svg, extracted.svg (and egraph.svg)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan, levels = compiled.plan, compiled.levels
    out = [pictures.write_svg(pictures.plan_dot(plan), directory / "plan.svg")]
    if levels.captured is not None:
        introduced = introduced_nodes(plan, levels.captured, levels.rules, compiled.report.matches)
        out.append(pictures.write_svg(pictures.graph_dot(levels.captured, "captured"), directory / "captured.svg"))
        out.append(pictures.write_svg(pictures.graph_dot(plan.graph, "extracted", introduced),
                                      directory / "extracted.svg"))
    center = _default_eclass(plan, levels.eclasses)
    if center is not None:
        out.append(pictures.write_svg(pictures.egraph_dot(levels.eclasses, center), directory / "egraph.svg"))
    return out


STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
.summary { color: #444; } .fallbacks { background: #fde8e6; border: 1px solid #e8a09a; padding: .5em 1em; }
.row { display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }
.picture { overflow: auto; max-height: 80vh; border: 1px solid #eee; padding: .3em; }
.picture svg { max-width: 100%; height: auto; }
.plan-picture { flex: 1 1 480px; } .detail-pane { flex: 1 1 480px; min-width: 360px; }
g[id^='kernel_'] { cursor: pointer; } g.selected polygon, g.selected path { stroke: #d33; stroke-width: 3; }
pre.code { background: #f6f6f6; padding: .6em; overflow: auto; font-size: 12px; max-height: 40em; }
table.facts th { text-align: left; padding-right: 1em; vertical-align: top; color: #555; }
table.grid { border-collapse: collapse; font-size: 13px; }
table.grid td, table.grid th { border: 1px solid #ddd; padding: 2px 8px; }
td.generated { background: #c8ecc8; } td.library { background: #c6dcf5; } td.aten { background: #f6c4c0; }
tr.kernel-row { cursor: pointer; } tr.kernel-row:hover { background: #f3f0ff; }
.swatch { display: inline-block; width: 1em; height: 1em; margin: 0 .3em 0 .8em; vertical-align: middle;
          border: 1px solid #999; }
"""

SCRIPT = """
function showKernel(name) {
  document.querySelectorAll('.kernel-detail').forEach(function (d) { d.hidden = d.id !== 'detail-' + name; });
  document.querySelectorAll("g[id^='kernel_']").forEach(function (g) {
    g.classList.toggle('selected', g.id === 'kernel_' + name); });
  var hint = document.getElementById('hint'); if (hint) { hint.hidden = true; }
}
document.querySelectorAll("g[id^='kernel_']").forEach(function (g) {
  g.addEventListener('click', function () { showKernel(g.id.slice('kernel_'.length)); });
});
document.querySelectorAll('tr.kernel-row').forEach(function (row) {
  row.addEventListener('click', function () { showKernel(row.dataset.kernel); });
});
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>
<body><h1>{title}</h1><p class='summary'>{summary}</p>{fallbacks}
<section><h2>Plan</h2><p>{legend} · click a kernel (box or row) for its ops, loop IR, source and cost.</p>
<div class='row'><div class='picture plan-picture'>{plan_svg}</div>
<div class='detail-pane'><p id='hint'>Click a kernel to see it here.</p>{details}
<table class='grid'><tr><th>kernel</th><th>kind</th><th>output</th><th>bytes</th><th>estimate</th><th>measured</th></tr>
{kernel_rows}</table></div></div><p><small>{extraction}</small></p></section>
<section><h2>Rewrites: captured graph and extracted graph</h2>
<p>Highlighted nodes of the extracted graph were introduced by rules; beside each, the rules that fired in this
compile and build that op (the candidates: egglog does not record which rule made an e-node).</p>
<div class='row'><div class='picture'><h4>captured</h4>{captured}</div>
<div class='picture'><h4>extracted</h4>{extracted}</div></div><ul>{rewrites}</ul></section>
<section><h2>Saturation</h2>{saturation}</section>
{egraph}
<section><h2>Every level's text</h2>{texts}</section>
<script>{script}</script></body></html>
"""

INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>egraph-compiler reports</title><style>{style}</style></head>
<body><h1>egraph-compiler reports</h1><p>One page per compiled graph, in compile order.</p><ol>{rows}</ol>
</body></html>
"""
