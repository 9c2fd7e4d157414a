import os, sys, random, subprocess, warnings, torch
warnings.simplefilter("ignore")
sys.path.insert(0, "/tmp")
from tests import programs as P
from tests.soak import _pick_mode
import egraph_compiler as egc
key = "2027:11:9"
rng = random.Random(key); mode = _pick_mode(rng)
p = P.generate(P.ChoiceDrawer(rng=rng), mode)
print(P.describe(p))
o = P.check(p); print("check ->", o.kind, o.detail[:300])
fn, inputs = P.build(p)
c = egc.compile(fn, inputs)
got, want = c(*inputs), fn(*inputs)
print("err", [(g - w).abs().max().item() for g, w in zip(got, want)])
print(c.plan)
print(c.source)
torch.set_num_threads(1)
print("torch", torch.__version__)
