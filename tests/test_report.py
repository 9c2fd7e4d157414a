"""The HTML report (htmlreport.py, pictures.py): written by compile(report=),
by `egc explain --html/--svg`, and per graph by EGC_REPORT under torch.compile;
loaded in a real headless Chromium (Debian's `chromium`, driven by playwright):
no console errors, one box per kernel, a click reveals the kernel's source, a
screenshot that is not blank.  Where no browser exists those tests skip, unless
EGC_REQUIRE_BROWSER is set (as .ci/run does, so CI cannot skip them)."""
import io
import os
import re
import shutil
import warnings

import pytest
import torch
from typer.testing import CliRunner

import egraph_compiler as egc
from egraph_compiler import workloads
from egraph_compiler.cli import app
from egraph_compiler.errors import EgraphCompilerError

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("EGC_REQUIRE_BROWSER"),
                               reason="Graphviz's dot is not installed (apt-get install graphviz)")
pytestmark = needs_dot


def _browser_or_skip():
    """playwright's sync API; skips where there is no browser, unless CI requires one."""
    required = os.environ.get("EGC_REQUIRE_BROWSER")
    if BROWSER is None:
        assert not required, "EGC_REQUIRE_BROWSER is set but no chromium is installed"
        pytest.skip("no headless Chromium here (Debian: apt-get install chromium)")
    if required:
        import playwright.sync_api
        return playwright.sync_api
    return pytest.importorskip("playwright.sync_api")


def _check_in_browser(path, kernels: list[str], shot):
    """Loads the page; returns nothing, asserts what a reader sees."""
    from PIL import Image
    sync_api = _browser_or_skip()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=BROWSER, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:")
                       else route.continue_())  # self-contained: any network request fails the page
            page.goto(path.as_uri())
            boxes = page.locator("g[id^='kernel_']")
            assert sorted(boxes.evaluate_all("gs => gs.map(g => g.id)")) == sorted(f"kernel_{k}" for k in kernels)
            assert page.locator(".kernel-detail:not([hidden])").count() == 0
            last = kernels[-1]
            page.locator(f"g#kernel_{last}").click()
            shown = page.locator(".kernel-detail:not([hidden])")
            assert shown.count() == 1 and shown.get_attribute("id") == f"detail-{last}"
            source = shown.locator("pre.source").inner_text()
            assert source.strip()
            png = page.screenshot()
            assert not errors, errors
        finally:
            browser.close()
    image = Image.open(io.BytesIO(png)).convert("L")
    shot.write_bytes(png)
    lo, hi = image.getextrema()
    assert hi - lo > 100 and len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20, "the screenshot is blank"
    return source


def test_report_of_gpt_block_renders_in_chromium(tmp_path):
    fn, inputs = workloads.make("gpt_block", "test")
    path = tmp_path / "gpt_block.html"
    compiled = egc.compile(fn, inputs, report=path)
    html = path.read_text()
    assert not re.search(r"(src|href)=['\"](https?:)?//", html)  # nothing fetched (the browser also refuses)
    names = [k.name for k in compiled.plan.kernels]
    assert len(re.findall(r'<g id="kernel_k\d+"', html)) == len(names)
    source = _check_in_browser(path, names, tmp_path / "shot.png")
    last = compiled.plan.kernels[-1]
    if last.kind == "generated":
        assert f"void {last.name}(" in source
    else:
        assert "no generated source" in source


def test_report_contents(tmp_path):
    """Saturation table and chart, rewrites with candidate rules, the e-graph view,
    fallbacks with the user's source line, measured times beside estimates."""
    def program(x, w):
        y = torch.layer_norm(x, (x.shape[-1],), w, None) * 2.0
        return torch.special.bessel_j0(y).relu()  # outside the vocabulary: an ATen fallback
    x, w = torch.randn(8, 32), torch.randn(32)
    with pytest.warns(UserWarning, match="bessel_j0"):
        compiled = egc.compile(program, [x, w], keep_egraph=True)
    path = compiled.write_report(tmp_path / "r.html", measure=[x, w])
    html = path.read_text()
    assert "class='fallbacks'" in html and "bessel_j0" in html and "test_report.py" in html
    assert "<polyline" in html and "phase (groups)" in html
    assert re.search(r"measured</th><td>\d+\.\d us", html)  # a kernel's measured time
    assert "The e-graph around e-class" in html and "cluster_" in html
    assert "<code>inline</code>" in html  # the fused producer, with the fuse rules that fit
    torch.testing.assert_close(compiled(x, w), program(x, w))


def test_report_needs_graphviz(tmp_path, monkeypatch):
    fn, inputs = workloads.make("ln_relu", "test")
    compiled = egc.compile(fn, inputs, keep_egraph=True)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    with pytest.raises(EgraphCompilerError, match="apt-get install graphviz"):
        compiled.write_report(tmp_path / "r.html")


def test_report_per_graph_of_gpt2_through_torch_compile(tmp_path, monkeypatch):
    """EGC_REPORT=DIR: a page per graph Dynamo hands over, and an index page."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.randint(0, 128, (2, 16))
    monkeypatch.setenv("EGC_REPORT", str(tmp_path / "reports"))
    torch._dynamo.reset()
    egc.last_plans(clear=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings' fallbacks (warned once per process)
        expected = model(ids).logits
        got = torch.compile(model, backend="egraph")(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    plans = egc.last_plans()
    pages = sorted((tmp_path / "reports").glob("graph*.html"))
    assert len(pages) == len(plans) >= 1
    index = (tmp_path / "reports" / "index.html").read_text()
    assert all(p.name in index for p in pages)
    biggest = max(range(len(plans)), key=lambda i: len(plans[i].kernels))
    _check_in_browser(pages[biggest], [k.name for k in plans[biggest].kernels], tmp_path / "gpt2.png")


def test_egc_explain_writes_html_and_svg(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["explain", "softmax", "--level", "plan", "--html", str(tmp_path / "s.html"),
                              "--svg", str(tmp_path / "svg"), "--measure"])
    assert out.exit_code == 0, out.output
    assert "measured" in (tmp_path / "s.html").read_text()
    assert sorted(p.name for p in (tmp_path / "svg").iterdir()) == ["captured.svg", "egraph.svg", "extracted.svg",
                                                                   "plan.svg"]
    assert (tmp_path / "svg" / "plan.svg").read_text().startswith("<svg")
    bad = runner.invoke(app, ["explain", "softmax", "--eclass", "T-0", "--level", "plan"])
    assert bad.exit_code == 2 and "goes with --html" in bad.output


def test_egc_explain_on_a_terminal_shows_a_plan_table_and_highlighted_source(capsys):
    from egraph_compiler.cli import _show
    fn, inputs = workloads.make("mlp_gelu", "test")
    compiled = egc.compile(fn, inputs)
    _show(compiled, "all")
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if "\u2502" in line and " us" in line]  # rich's table rows
    assert len(table) == len(compiled.plan.kernels)
    assert all(k.kind in row and k.name in row for k, row in zip(compiled.plan.kernels, table))
    assert 'extern "C" void k' in out and "=== plan ===" not in out


@pytest.mark.parametrize("name", workloads.NAMES)
def test_egc_explain_and_its_report_for_every_workload(name, tmp_path):
    """Acceptance of the CLI: `egc explain` exits 0 on each of the seven workloads,
    and its report draws one box per kernel of the plan it printed."""
    args = ["explain", name, "--level", "plan", "--html", str(tmp_path / "r.html")] + \
        (["--unsafe"] if name == "algebra" else [])
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    kernels = int(re.search(r"plan: (\d+) kernel", out.output).group(1))
    assert len(re.findall(r'<g id="kernel_k\d+"', (tmp_path / "r.html").read_text())) == kernels
