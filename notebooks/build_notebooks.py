"""Writes the notebooks in this folder (run it after editing their cells here): python notebooks/build_notebooks.py"""
import nbformat as nbf
from pathlib import Path

OUT = Path(__file__).resolve().parent

def nb(cells):
    book = nbf.v4.new_notebook()
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    book.cells = [nbf.v4.new_markdown_cell(c[3:]) if c.startswith("md:") else nbf.v4.new_code_cell(c) for c in cells]
    return book

SETUP = """import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 4096 if DEVICE == "cuda" else 1024   # small sizes on a laptop CPU
print(DEVICE, N, torch.__version__)"""

tour = nb([
"md:# Tour: a new mask from scratch\n\nDefine a mask, look at its blocks, verify it against an eager float64 reference, export its porting spec, then play with it in the app. Runs on a CPU at small sizes and uses the GPU when there is one.",
SETUP,
"md:## 1. Define\n\nA plain FlexAttention `mask_mod`: causal sliding window plus a few *global* tokens every `stride` positions that every query may see (a common long-context recipe). The workbench takes any function with FlexAttention's signature.",
"""from workbench import Mask, probe

WINDOW, STRIDE = 128, 256

def window_with_globals(b, h, q_idx, kv_idx):
    causal = kv_idx <= q_idx
    near = q_idx - kv_idx < WINDOW
    is_global = kv_idx % STRIDE == 0
    return causal & (near | is_global)

mask = Mask("window_with_globals", mask_mod=window_with_globals,
            description="Causal window of 128 plus a global token every 256 positions.")
probe(mask)   # raises a readable error for `if` / `.item()` / non-bool returns
mask.summary""",
"md:## 2. Build blocks and look",
"""from workbench import look
from workbench.blocks import scan_blocks
from workbench.analyze import mask_stats

scan = scan_blocks(mask, N, N, device=DEVICE)
look.block_map(scan, title=mask.name)""",
"""mask_stats(scan).to_frame()""",
"""# where to look: the first block that differs from plain causal attention (the same rule as the
# report's and the app's token views); the picture says why it looks there
where = look.focus(scan, 512, mask=mask, device=DEVICE)
look.token_view(mask, where.q_range, where.kv_range, device=DEVICE, why=where.reason)""",
"md:## 3. Verify\n\nFlexAttention (compiled on a GPU, uncompiled on the CPU) against a chunked float64 reference on fresh random inputs.",
"""from workbench.run import Shape
from workbench.verify import verify

verdict = verify(mask, Shape(batch=1, q_heads=4, q_len=min(N, 1024), head_dim=64),
                 dtype="bfloat16" if DEVICE == "cuda" else "float32", device=DEVICE, compile=DEVICE == "cuda")
print(verdict.line)
verdict.to_frame()[["max_abs_err", "rel_err", "worst", "passed"]]""",
"md:## 4. Export the porting spec\n\nEvery backend form in the spec reproduces the mask exactly; the others say why not.",
"""from workbench.export import build_spec, write_spec

spec = build_spec(mask, 512, 512, seed=0)
path, _ = write_spec(spec, "out/tour")
print(path, spec.doc["pattern"])
spec.backends_view()   # each exact backend's arguments, each reason in full""",
"md:## 5. The app\n\nChange the mask, its parameters, the lengths or the block size; every tab follows. Errors in your code show up as a short message and the app keeps working.",
"""from workbench import Workbench

app = Workbench("causal_sliding_window", q_len=N)
app""",
])

gallery = nb([
"md:# Gallery: the built-in mask library\n\nEvery pattern in `masks/`, one factory per file: block map, density and the backends that can run it exactly.",
SETUP,
"""import pandas as pd
from workbench import library, make, look
from workbench.blocks import scan_blocks
from workbench.analyze import mask_stats

rows, maps = [], {}
for name, factory in library().items():
    mask = make(factory, q_len=N, kv_len=N, device=DEVICE)
    if mask.mask_mod is None:
        rows.append(dict(mask=mask.name, kind="score_mod", summary=mask.summary))
        continue
    scan = scan_blocks(mask, N, N, heads=mask.heads, device=DEVICE)
    stats = mask_stats(scan)
    maps[mask.name] = scan
    rows.append(dict(mask=mask.name, kind="mask_mod", density=round(stats.density, 4),
                     block_sparsity=round(stats.block_sparsity, 4), summary=mask.summary))
pd.DataFrame(rows)""",
"""import matplotlib.pyplot as plt
from IPython.display import display

for name, scan in maps.items():
    fig = look.block_map(scan, title=name, max_panels=4)
    display(fig)
    plt.close(fig)""",
"md:## Which backends can run each pattern exactly",
"""from workbench.export import build_spec

table = []
for name, factory in library().items():
    mask = make(factory, q_len=512, kv_len=512)
    spec = build_spec(mask, 512, 512, heads=mask.heads, golden=False, generalize=False)
    table.append({"mask": mask.name, **{t: ("yes" if t in spec.supported else "no") for t in
                  ("flash_attn", "vllm_triton", "magi", "flashmask", "triton")}})
pd.DataFrame(table).set_index("mask")""",
])

porting = nb([
"md:# Porting walk-through: a Gemma-3-style bidirectional image-span mask\n\nText is causal; the tokens of each image attend to each other in both directions. We export the porting spec, read it as a backend engineer would, and run its golden vectors against two ports written with plain PyTorch SDPA.",
SETUP,
"""from workbench import make
from workbench.export import build_spec, write_spec, load_spec, conformance

L = 512
mask = make("image_spans", {"spans": [[40, 103], [300, 363]]}, q_len=L, kv_len=L)
spec = build_spec(mask, L, L, heads=2, seed=0)
path, tensors = write_spec(spec, "out/porting")
print(path, tensors.name)""",
"md:## Read the spec\n\nWhat the mask is (`pattern`), which backends reproduce it exactly and with which arguments, and why the others cannot.",
"""import json

doc = json.loads(path.read_text())
print(json.dumps({k: doc[k] for k in ("pattern", "score", "shape")}, indent=1))
print(json.dumps(doc["backends"]["vllm_triton"], indent=1))
for target, reason in doc["unsupported"].items():
    print(f"not {target}: {reason}")""",
"md:## Port 1: SDPA with a dense mask read from the spec's row intervals",
"""import torch
import torch.nn.functional as F

def sdpa_dense_port(q, k, v, spec):
    Lq, Lk = spec["shape"]["q_len"], spec["shape"]["kv_len"]
    keep = torch.zeros(Lq, Lk, dtype=torch.bool)
    for i, row in enumerate(spec["backends"]["row_intervals"]["rows"]):
        for start, end in torch.as_tensor(row).reshape(-1, 2).tolist():
            keep[i, start:end] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

report = conformance(path, sdpa_dense_port)
print(report.line)
report.to_frame()""",
"md:## Port 2: the vLLM TritonAttention arguments, read with their documented semantics",
"""def vllm_triton_port(q, k, v, spec):
    s = spec["backends"]["vllm_triton"]
    Lq, Lk = spec["shape"]["q_len"], spec["shape"]["kv_len"]
    a = torch.arange(Lq)[:, None] + (Lk - Lq)
    j = torch.arange(Lk)[None, :]
    keep = j <= a                                    # decoder
    for start, end in s["mm_prefix_ranges"] or []:   # inclusive bidirectional ranges
        keep |= (a >= start) & (a <= end) & (j >= start) & (j <= end)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

print(conformance(path, vllm_triton_port).line)""",
"md:## Port 3: the FlashAttention kwargs interpretation\n\nThe spec has no `flash_attn` section for this mask (see the reason above). A port that uses the closest FA setting, `causal=True`, loses the bidirectional spans; the golden vectors catch it.",
"""def fa_causal_port(q, k, v, spec):
    # flash_attn_func(q, k, v, causal=True), written with SDPA (no flash_attn package needed)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

bad = conformance(path, fa_causal_port)
print(bad.line)
bad.to_frame()""",
"""assert report.passed and conformance(path, vllm_triton_port).passed and not bad.passed""",
])

debugging = nb([
"md:# Debugging story: an off-by-one window and rows that keep nothing",
SETUP,
"md:## An off-by-one window\n\nThe intent: each query sees itself and the 63 keys before it (a window of 64). The draft uses `<=` where it meant `<`.",
"""from workbench import Mask, look, make

intended = make("causal_sliding_window", {"window": 64})

def draft_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 64)   # bug: <= keeps 65 keys

draft = Mask("draft_window", mask_mod=draft_window)
look.diff_view(intended, draft, (0, 160), (0, 160))""",
"""diff = look.count_differences(intended, draft, N, N)
diff""",
"""from workbench.run import Shape
from workbench.verify import verify

verdict = verify(draft, Shape(q_heads=2, q_len=512, head_dim=64), dtype="float32", device=DEVICE,
                 compile=DEVICE == "cuda", expected=intended)
print(verdict.line)       # FAIL, with the worst element's location""",
"md:## Rows that keep nothing\n\nPadding queries in a packed batch (positions past the last document) keep no key. FlexAttention returns 0 there; a textbook softmax over a dense mask (what a hand-written kernel computes) returns NaN.",
"""import torch

L = 512
doc_id = torch.repeat_interleave(torch.arange(3), torch.tensor([300, 200, 12])).to(DEVICE)  # 2 documents, 12 padding tokens

def packed_documents(b, h, q_idx, kv_idx):
    real = doc_id[q_idx] < 2
    return real & (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)

packed = Mask("packed_documents", mask_mod=packed_documents, data={"doc_id": doc_id})
from workbench.blocks import scan_blocks
from workbench.analyze import mask_stats
stats = mask_stats(scan_blocks(packed, L, L, device=DEVICE))
stats.fully_masked_rows, stats.fully_masked_row_examples[:3]""",
"""look.token_view(packed, (440, 512), (440, 512), device=DEVICE)""",
"""verdict = verify(packed, Shape(q_heads=2, q_len=L, head_dim=64), dtype="float32", device=DEVICE,
                 compile=DEVICE == "cuda")
print(verdict.line)
for f in verdict.findings:
    print(f.kind, "-", f.message)""",
"""from workbench.export import build_spec, write_spec, conformance
import torch.nn.functional as F

path, _ = write_spec(build_spec(packed, L, L, seed=0, device=DEVICE), "out/debugging")

def dense_keep(spec):
    keep = torch.zeros(L, L, dtype=torch.bool)
    for i, row in enumerate(spec["backends"]["row_intervals"]["rows"]):
        for s, e in torch.as_tensor(row).reshape(-1, 2).tolist():
            keep[i, s:e] = True
    return keep

def softmax_port(q, k, v, spec):
    # the textbook kernel: softmax over the kept scores, then a weighted sum
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~dense_keep(spec), float("-inf")), dim=-1) @ v

naive = conformance(path, softmax_port)
print(naive.line)
naive.to_frame()[["passed", "nan_count", "message"]]""",
"md:The fix in the port: rows that keep nothing must give 0, as FlexAttention does.",
"""def softmax_port_fixed(q, k, v, spec):
    out = softmax_port(q, k, v, spec)
    keeps_something = dense_keep(spec).any(dim=-1)[:, None]
    return torch.where(keeps_something, out, 0.0)

print(conformance(path, softmax_port_fixed).line)""",
"md:(Recent torch versions make SDPA's math path return 0 for such rows too; fused kernels and other frameworks differ, which is why the spec lists `hazards.fully_masked_rows` and the golden vectors include those rows.)",
])

for name, book in (("01_tour", tour), ("02_gallery", gallery), ("03_porting_gemma3_spans", porting), ("04_debugging", debugging)):
    nbf.write(book, OUT / f"{name}.ipynb")
print("ok")
