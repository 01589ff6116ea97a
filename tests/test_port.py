"""The generated Triton port: a standalone file that imports torch and triton only, run from its
files alone (a fresh process; Triton's CPU interpreter here, the GPU in test_gpu_port.py) and
judged against the float64 reference and the spec's golden vectors."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench import Mask, make, port
from workbench.cli import main
from workbench.define import WorkbenchError
from workbench.run import Shape, make_inputs
from workbench.verify import verify
from workbench.run import PortBackend

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from run_port_corpus import case_ids  # noqa: E402


CORPUS_IDS = case_ids(10, ["float32"], conformance=True)


@pytest.fixture(scope="module")
def corpus_results(early_run):
    """One fresh interpreter process runs every case (tests/run_port_corpus.py); each is judged below."""
    out = early_run("port_corpus")  # run_port_corpus.py cpu 10 float32 conformance, started at collection
    results = {line.split()[1]: line for line in out.stdout.splitlines() if line.startswith("CASE ")}
    assert results, out.stdout[-4000:] + out.stderr[-3000:]
    return results


@pytest.mark.parametrize("case", CORPUS_IDS)
def test_ports_of_the_corpus_and_random_mods_match_the_reference_and_goldens(corpus_results, case):
    """49 corpus mods (library, user-style, attention-gym-style), 10 random grammar mods and 8
    library specs' golden vectors through `conformance`: each port matches (fp32, interpreter)."""
    line = corpus_results.get(case)
    assert line is not None, f"{case} did not run"
    assert line.split()[2] == "OK", line


def test_generated_file_imports_only_torch_and_triton(tmp_path):
    from workbench import port

    path = port.build(make("image_spans", q_len=300, kv_len=300), 300, 300, out_dir=tmp_path)
    tree = ast.parse(path.read_text())
    # the modules named: `import a.b` names a; `from a.b import c` names a too (c is a name inside it)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {node.module.split(".")[0] if node.module else "." for node in ast.walk(tree)
                                           if isinstance(node, ast.ImportFrom)}
    # (the standard library's, and torch and triton: nothing else to install)
    assert imported <= {"json", "math", "os", "struct", "threading", "warnings", "torch", "triton"}, imported
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "compile" not in names and not any("flex" in n.lower() for n in names), names
    assert (tmp_path / path.name.replace(".py", ".safetensors")).exists()  # the spans table


@pytest.mark.parametrize("q_len", [1, 7, 16])
def test_decode_shapes(q_len):
    """A few queries against many keys (decode, chunked prefill) take the port's 16-row configs."""
    mask = make("causal_sliding_window", {"window": 100}, q_len=q_len, kv_len=300)
    verdict = verify(mask, Shape(q_heads=2, q_len=q_len, kv_len=300, head_dim=32), dtype="float32", backend="port",
                     seed=0)
    assert verdict.passed, verdict.line


def test_rows_that_keep_nothing_give_zero_and_minus_inf():
    from workbench import port

    def late_keys(b, h, q_idx, kv_idx):  # rows 0..9 keep nothing
        return (kv_idx <= q_idx) & (kv_idx >= 10)

    mask = Mask("late_keys", mask_mod=late_keys)
    inputs = make_inputs(Shape(q_len=40, head_dim=16), "float32", seed=0)
    path = port.build(mask, 40, 40)
    out, lse = port.run_file(path, inputs.q, inputs.k, inputs.v)
    assert torch.equal(out[0, 0, :10], torch.zeros(10, 16)) and torch.isneginf(lse[0, 0, :10]).all()
    assert torch.isfinite(lse[0, 0, 10:]).all() and not torch.isnan(out).any()
    verdict = verify(mask, Shape(q_len=40, head_dim=16), dtype="float32", seed=0, backend=PortBackend(path))
    assert verdict.passed and verdict.fully_masked_rows == 10, verdict.line


def test_a_data_bound_port_refuses_other_lengths(tmp_path):
    from workbench import port

    path = port.build(make("document", {"doc_lengths": [50, 50]}, q_len=100, kv_len=100), 100, 100, out_dir=tmp_path)
    inputs = make_inputs(Shape(q_len=120, head_dim=16), "float32", seed=0)
    with pytest.raises(WorkbenchError, match=r"refused the call.*reads data sized for Lq = 100"):
        port.run_file(path, inputs.q, inputs.k, inputs.v)


def test_a_parametric_port_runs_at_any_length(tmp_path):
    from workbench import port

    mask = make("causal_sliding_window", {"window": 50})
    path = port.build(mask, 128, 128, out_dir=tmp_path)
    for n in (77, 301):
        verdict = verify(mask, Shape(q_len=n, head_dim=16), dtype="float32", seed=1, backend=PortBackend(path))
        assert verdict.passed, verdict.line


def test_port_command_writes_verifies_and_reports(capsys, tmp_path):
    rc = main(["port", "per_head_window", "--param", "windows=[8,32,64,128]", "--score", "softcap", "--q-len", "150",
               "--kv-len", "200", "--device", "cpu", "--head-dim", "16", "-o", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "(Triton port)" in out, out
    assert "up to 4 query heads" in out
    assert list(tmp_path.glob("*_attention.py")) and list(tmp_path.glob("*_attention.safetensors"))


def test_verify_backend_port_fails_a_wrong_port(tmp_path):
    """The check can fail: a port generated for one mask, judged as another, FAILs."""
    from workbench import port

    path = port.build(make("causal_sliding_window", {"window": 16}), 64, 64, out_dir=tmp_path)
    verdict = verify(make("causal_sliding_window", {"window": 17}), Shape(q_len=64, head_dim=16), dtype="float32",
                     seed=0, backend=PortBackend(path))
    assert not verdict.passed


def test_untranslatable_mods_get_a_clear_error(capsys, tmp_path):
    target = tmp_path / "signed.py"
    target.write_text("def signed(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx).sign() >= 0\n")
    rc = main(["port", f"{target}:signed", "--q-len", "64", "--device", "cpu", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be written as Triton" in err and "sign" in err and "Traceback" not in err


def test_export_lists_and_writes_the_port(tmp_path):
    from workbench.export import build_spec, load_spec, write_spec

    spec = build_spec(make("prefix_lm", {"prefix_len": 40}), 128, 128, golden=False)
    json_path, _ = write_spec(spec, tmp_path)
    section = load_spec(json_path).doc["backends"]["triton_attention"]
    assert section["entry"] == "attention" and section["q_len"] is None and "any Lq <= Lk" in section["valid_for"]
    assert section["length_rules"] == {"len_offset": [-1, 1, 0, 1]} and section["relations"] == ["lt", "eq"]
    assert (tmp_path / section["file"]).exists()


def test_packed_documents_with_cu_seqlens_match_the_reference(tmp_path):
    # a document mask run segment by segment (tiles from each document's start) gives the same
    # attention as the whole packed sequence, within float32 rounding, and both match the reference
    from workbench import port
    from workbench.verify import reference_attention

    lengths = [70, 3, 131, 96]
    mask = make("document", {"doc_lengths": lengths}, q_len=300, kv_len=300)
    path = port.build(mask, 300, 300, heads=2, out_dir=tmp_path)
    inputs = make_inputs(Shape(q_heads=2, q_len=300, head_dim=16), "float32", seed=4)
    whole, whole_lse = port.run_file(path, inputs.q, inputs.k, inputs.v)
    cu = torch.tensor([0, 70, 73, 204, 300])
    packed, packed_lse = port.run_file(path, inputs.q, inputs.k, inputs.v, cu_seqlens=cu)
    ref = reference_attention(mask, inputs)
    torch.testing.assert_close(packed.double(), ref.out, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(packed_lse.double(), ref.lse, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(packed, whole, rtol=2e-5, atol=2e-6)
    with pytest.raises(WorkbenchError, match="cu_seqlens must rise from 0 to L = 300"):
        port.run_file(path, inputs.q, inputs.k, inputs.v, cu_seqlens=torch.tensor([0, 70, 200]))


def test_a_pinned_config_outside_the_list_is_named(tmp_path):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(WorkbenchError, match="config 12 is not one of the port's 7 tile configurations"):
        port.run_file(tmp_path / "missing.py", q, q, q, config=12)


def test_a_block_cut_short_by_the_last_query_is_full_when_its_rows_keep_everything(tmp_path):
    """Causal at 300 tokens, 128-blocks: the last row of blocks has 44 rows. Its blocks left of the
    diagonal keep every pair of those rows, so the port runs them unmasked (full); only the
    diagonal block, cut short by the last key as well, is partial. (Every block of a packed
    segment's last row was partial before: the segment-relative launch's extra masked work.)"""
    path = port.build(make("causal"), 300, 300, out_dir=tmp_path)
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('p', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "pn, pi, fn, fi = m.block_lists(1, 1, 300, 300, 'cpu'); print(fn.flatten().tolist(), pn.flatten().tolist())")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.stdout.strip() == "[0, 1, 2] [1, 1, 1]", out.stdout + out.stderr[-2000:]


def test_a_correct_port_verifies_in_bfloat16_on_a_cpu():
    # Triton's CPU interpreter multiplies bfloat16 operands of tl.dot as raw bits (values near 1e9);
    # the port widens them there, so a correct port is not reported wrong in verify's default dtype
    from workbench.verify import verify

    verdict = verify(make("causal", q_len=100, kv_len=100), Shape(q_heads=2, q_len=100, head_dim=16),
                     dtype="bfloat16", device="cpu", backend="port", seed=0)
    assert verdict.passed, verdict.line
    assert verdict.line.startswith("PASS")


def test_a_packed_launch_that_fits_no_tiles_names_the_cause_and_the_fix(tmp_path):
    # a GPU without room for any packed tile configuration (Triton's OutOfResources for each): the
    # file says which sizes did not fit and what to change, instead of Triton's traceback
    path = port.build(make("causal", q_len=64, kv_len=64), 64, 64, heads=1, out_dir=tmp_path)
    script = f"""
import importlib.util, triton, torch
spec = importlib.util.spec_from_file_location("p", {str(path)!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
class Full:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise triton.runtime.errors.OutOfResources(232448, 196608, "shared memory")
        return launch
m._attention_kernel.fn = Full()
q = torch.randn(1, 1, 64, 16)
try:
    m.attention(q, q, q, cu_seqlens=[0, 30, 64])
except RuntimeError as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert "no packed-launch tile configuration of [(32, 32, 4, 1)]" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "head dim 16 in torch.float32" in done.stdout and "add a smaller one to SEGMENT_CONFIGS" in done.stdout


def test_the_autotuner_is_consulted_once_per_key(tmp_path):
    # the forward launches with the tiles its autotuner chose once per key (length buckets, head
    # dim, dtypes), not through the autotuner's per-call argument dict: the autotuner runs once for
    # two calls at one length, once more at another bucket, and the answers are the same bits
    path = port.build(make("causal"), 64, 64, heads=1, out_dir=tmp_path)
    script = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("p", {str(path)!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
runs = []
tuner_run = m._attention_kernel.run
def counted(*args, **kwargs):
    runs.append(1)
    return tuner_run(*args, **kwargs)
m._attention_kernel.run = counted
q, k, v = (torch.randn(1, 2, 50, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
a = m.attention(q, k, v)
b = m.attention(q, k, v)
print("after two calls", len(runs), len(m._tuned_for), torch.equal(a, b))
q2 = torch.randn(1, 2, 300, 16)
m.attention(q2, q2, q2)
m.attention(q2, q2, q2)
print("after another length", len(runs), len(m._tuned_for))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert "after two calls 1 1 True" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "after another length 2 2" in done.stdout, done.stdout + done.stderr[-2000:]


def test_float32_at_wide_head_dims_runs_one_small_tile_without_autotuning(tmp_path):
    # compiled for sm_90, float32 at D = 128 needs 256-352 KB of shared memory in bf16's long-row tiles
    # (an H200 has 227 KB) and each took 50-260 s to compile, (64, 32, 4, 1) 43 s at D = 128 and 210 s
    # at D = 256: such a call keeps exactly one tile, (16, 32, 4, 1), a small one that fits and compiles
    # in seconds, and only there
    import triton

    module = port.load(port.build(make("causal", q_len=64, kv_len=64), 64, 64, heads=1, out_dir=tmp_path))
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in port.CONFIGS]

    def tried(dtype, head_dim, q_len):
        args = {"Lq_bucket": q_len, "Q": torch.empty(1, dtype=dtype), "D": head_dim}
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in module._prune(configs, args)]

    wide = port.CONFIGS[len(port.CONFIGS) - port.WIDE_ROW_CONFIGS:]
    assert wide == [module.WIDE_TILE]  # (CONFIGS's tail is WIDE_TILE)
    assert tried(torch.bfloat16, 128, 4096) == port.CONFIGS[:4]
    assert tried(torch.bfloat16, 256, 4096) == port.CONFIGS[:4]
    assert tried(torch.float32, 64, 4096) == port.CONFIGS[:4]
    for head_dim in (96, 128, 160, 256):
        assert tried(torch.float32, head_dim, 4096) == tried(torch.float32, head_dim, 1) == [(16, 32, 4, 1)]
    assert tried(torch.bfloat16, 128, 1) == [(16, 64, 4, 3), (16, 128, 4, 2)]
    assert not set(wide) & set(tried(torch.float16, 128, 4096) + tried(torch.float16, 128, 1)
                               + tried(torch.bfloat16, 256, 1) + tried(torch.float32, 64, 1))
    # the file launches that tile without the autotuner (which would time even a single one), for
    # long rows, decode and packed launches alike (not the first of SEGMENT_CONFIGS)
    for head_dim, want in ((128, (16, 32, 4, 1)), (256, (16, 32, 4, 1)), (64, None)):
        assert module._wide_tile(torch.float32, head_dim) == want
        assert module._wide_tile(torch.bfloat16, head_dim) is None
    # the invariance check pins one configuration: the one such calls run
    assert port.CONFIGS[port.pinned_config(torch.float32, 128)] == (16, 32, 4, 1)
    assert port.CONFIGS[port.pinned_config(torch.float32, 256)] == (16, 32, 4, 1)
    assert port.pinned_config(torch.bfloat16, 256) == 0 and port.pinned_config(torch.float32, 64) == 0


def test_float32_at_wide_head_dims_launches_its_tile_without_the_autotuner(tmp_path):
    # Triton's autotuner times even the single configuration a prune leaves it; float32 at D > 64
    # skips it: the file launches its one tile straight (and remembers it per key), while bf16 and
    # float32 at D 64 still go through the autotuner
    module = port.load(port.build(make("causal", q_len=64, kv_len=64), 64, 64, heads=1, out_dir=tmp_path))
    module._ONLY_CONFIG = None  # (as on a GPU: the CPU interpreter pins one small tile)
    launched = []

    class Kernel:
        arg_names = module._attention_kernel.arg_names

        class fn:  # the plain kernel: what a launch with fixed tiles calls
            def __class_getitem__(cls, grid):
                return lambda *a, **kw: launched.append(("fixed", kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"],
                                                         kw["num_stages"]))

        def __getitem__(self, grid):  # the autotuner
            return lambda *a, **kw: launched.append(("autotuned",))

    module._attention_kernel = Kernel()
    names = Kernel.arg_names

    def call(dtype, head_dim, q_len):
        args = [None] * len(names)
        args[0] = torch.empty(1, dtype=dtype)
        args[names.index("Lq_bucket")], args[names.index("Lk_bucket")] = q_len, 4096
        args[names.index("D")] = head_dim
        module._launch_tuned((1,), args, {"D_PAD": max(16, 1 << (head_dim - 1).bit_length()), "HAS_SCORE": False,
                                          "IEEE": dtype == torch.float32})
        return launched.pop()

    assert call(torch.float32, 128, 4096) == call(torch.float32, 128, 1) == ("fixed", 16, 32, 4, 1)
    assert call(torch.float32, 256, 4096) == call(torch.float32, 256, 4096) == ("fixed", 16, 32, 4, 1)
    assert call(torch.float32, 64, 4096) == ("autotuned",)
    assert call(torch.bfloat16, 256, 4096) == ("autotuned",)


def test_a_sites_launch_takes_the_lean_path_only_where_it_is_built_on_and_hook_free(tmp_path):
    """_launch at a known site: the lean launch when the site has one and LEAN_LAUNCH is on; Triton's
    own launcher (with the site's values after the arguments) when the lean one declines (a hook is
    set), when there is none, or when LEAN_LAUNCH is off. _lean_launch builds none for a compiled
    kernel it does not know, or for a Triton version outside LEAN_TRITON."""
    path = port.build(make("causal"), 64, 64, heads=1, out_dir=tmp_path)
    script = f"""
import importlib.util, types
spec = importlib.util.spec_from_file_location("p", {str(path)!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
calls = []
runner = lambda *a: calls.append(("triton", a))
def lean_with(answer):
    def lean(args):
        calls.append(("lean", tuple(args)))
        return answer
    return lean
for name, lean, switch in (("taken", lean_with(True), True), ("declined", lean_with(False), True),
                           ("none", None, True), ("off", lean_with(True), False)):
    calls.clear()
    m.LEAN_LAUNCH = switch
    m._SITES["site"] = (runner, [7], lean)
    m._launch(None, (1,), (1, 2), {{}}, "site")
    print(name, calls)
print("unknown", m._lean_launch(object(), (1, 1, 1), (1, 2), [7]))
m.LEAN_TRITON = ("0.0.",)
fake = types.SimpleNamespace(run=None)
print("version", m._lean_launch(fake, (1, 1, 1), (1, 2), [7]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    out = done.stdout
    assert "taken [('lean', (1, 2))]" in out, out + done.stderr[-2000:]
    assert "declined [('lean', (1, 2)), ('triton', (1, 2, 7))]" in out, out
    assert "none [('triton', (1, 2, 7))]" in out, out
    assert "off [('triton', (1, 2, 7))]" in out, out
    assert "unknown None" in out and "version None" in out, out


def test_the_lean_launch_passes_addresses_in_the_launchers_order_and_declines_while_a_hook_is_set(tmp_path):
    """The lean launch itself, built over a stand-in compiled kernel (its launcher a builtin that
    prints what it gets) and the compile tests' stand-in driver: grid, stream, function, the
    launcher's flags and metadata, then each argument (a tensor as its address) and the site's values
    after them; it returns False, launching nothing, while a launch hook is set (in Triton's hook
    chain, or set in its place as a plain function) and when an argument is not of the site's kind."""
    path = port.build(make("causal"), 64, 64, heads=1, out_dir=tmp_path)
    script = f"""
import importlib.util, sys, types, torch, triton
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from run_hopper_compile import _Target
triton.runtime.driver.set_active(_Target())
torch.cuda.current_device = lambda: 0
spec = importlib.util.spec_from_file_location("p", {str(path)!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
m.LEAN_TRITON = (triton.__version__[:4],)
launcher = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                                 launch_cooperative_grid=False, launch_pdl=True, launch=print)
fake = types.SimpleNamespace(run=launcher, src=types.SimpleNamespace(signature={{"X": "*fp32", "n": "i32",
                             "FLAG": "constexpr"}}), metadata=types.SimpleNamespace(), function=1234,
                             packed_metadata=(4, 1, 0))
t = torch.zeros(4)
lean = m._lean_launch(fake, (2, 1, 1), (t, 5), [True])
print("ADDRESS", t.data_ptr())
print("TAKEN", lean((t, 5)))
hook = lambda metadata: None
triton.knobs.runtime.launch_enter_hook.add(hook)
print("HOOKED", lean((t, 5)))
triton.knobs.runtime.launch_enter_hook.remove(hook)
chain = triton.knobs.runtime.launch_exit_hook
triton.knobs.runtime.launch_exit_hook = hook
print("PLAIN", lean((t, 5)))
triton.knobs.runtime.launch_exit_hook = chain
print("KIND", lean((5, 5)))
print("AGAIN", lean((t, 5)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    lines = done.stdout.splitlines()
    address = next((ln.split()[1] for ln in lines if ln.startswith("ADDRESS")), None)
    assert address is not None, done.stdout + done.stderr[-3000:]
    launches = [ln for ln in lines if ln.startswith("2 1 1 ")]
    assert launches == [f"2 1 1 0 1234 False True None None (4, 1, 0) None None None {address} 5 True"] * 2, lines
    assert lines.index("TAKEN True") > lines.index(launches[0])
    for word in ("HOOKED", "PLAIN", "KIND"):
        assert f"{word} False" in lines, lines
    assert "AGAIN True" in lines, lines


def test_the_lean_launch_encodes_a_descriptor_once_per_address_shape_and_strides(tmp_path):
    """_tensor_map, what the lean launch passes for a descriptor argument: the tensor map encoded for
    a tensor's address, shape and strides is reused while they recur (a training loop's allocator
    hands the same addresses back), encoded again for any other address, shape or strides, never
    more than _TMA_CACHE_SIZE kept per argument, and encoded on every launch with LEAN_TMA_CACHE off."""
    from types import SimpleNamespace

    module = port.load(port.build(make("causal"), 64, 64, heads=1, out_dir=tmp_path))
    encoded = []

    def encode(desc, meta):  # (Triton's make_tensordesc_arg: the map, then shape and strides)
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), meta))
        return [f"map{len(encoded)}", *desc.shape, *desc.strides]

    a, b = torch.zeros(256, 64), torch.zeros(256, 64)
    desc = lambda t, rows=256, cols=64: SimpleNamespace(base=t, shape=[rows, cols], strides=[cols, 1], padding="zero")
    known = {}
    first = module._tensor_map(known, desc(a), "meta", encode)
    assert first == ["map1", 256, 64, 64, 1]
    assert module._tensor_map(known, desc(a), "meta", encode) == first and len(encoded) == 1  # (the same tensor)
    other = module._tensor_map(known, desc(b), "meta", encode)  # another address: its own map
    assert other[0] == "map2" and encoded[-1][0] == b.data_ptr()
    assert module._tensor_map(known, desc(a[:128], 128), "meta", encode)[0] == "map3"  # same address, other shape
    assert module._tensor_map(known, desc(a, 128, 128), "meta", encode)[0] == "map4"  # other strides
    assert module._tensor_map(known, desc(b), "meta", encode) == other and len(encoded) == 4
    views = [torch.zeros(16, 64) for _ in range(2 * module._TMA_CACHE_SIZE)]
    for t in views:
        module._tensor_map(known, desc(t, 16), "meta", encode)
    assert len(known) <= module._TMA_CACHE_SIZE and len(encoded) == 4 + len(views)
    module.LEAN_TMA_CACHE = False
    try:
        module._tensor_map({}, desc(a), "meta", encode)
        module._tensor_map({}, desc(a), "meta", encode)
        assert len(encoded) == 6 + len(views)
    finally:
        module.LEAN_TMA_CACHE = True
