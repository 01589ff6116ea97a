"""Compile the generated CuTe DSL on a CPU, for sm_90a, with the installed flash-attn-4 and cutlass
DSL (no GPU: FA4's documented CPU-only compilation). Two parts, one line per case:

1. every corpus mod's CuTe DSL, compiled inside a small kernel that calls it the way FA4 does
   (one-element TensorSSA indices, aux tensors as a list of global tensors);
2. generated FA4 files (mask only, score only, per-head table + score, spans with .any(), a length
   rule) whose `attention()` and its backward run under torch's FakeTensorMode: FA4's own Hopper
   forward and backward, with the file's mods, the score_mod's derivative, aux tensors and
   block-sparse tensors, are compiled and not launched.

Prints "OK name" or "FAIL name: why" per case, then "SUMMARY n compiled, m failed".

    python tests/run_fa4_compile.py [mods|files|all]
"""

from __future__ import annotations

import os

os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mod_corpus import LENGTH, corpus  # noqa: E402
from workbench import Mask, fa4, make  # noqa: E402
from workbench.define import bind, captured_tensors  # noqa: E402
from workbench.define.util import load_module  # noqa: E402
from workbench.fa4.generate import _aux_tensor  # noqa: E402
from workbench.translate.cute_dsl import cute_mods  # noqa: E402

HARNESS = '''import cutlass
import cutlass.cute as cute


@@MODS@@


@cute.kernel
def _kernel(out: cute.Tensor@@AUX_PARAMS@@):
    tidx, _, _ = cute.arch.thread_idx()
    b = _ssa(tidx % 2, cutlass.Int32)
    h = _ssa(tidx % 3, cutlass.Int32)
    q = _ssa(tidx, cutlass.Int32)
    kv = _ssa(tidx // 2, cutlass.Int32)
    out[tidx] = cutlass.Float32(0.0)
@@CALLS@@


@cute.jit
def launch(out: cute.Tensor@@AUX_PARAMS@@):
    _kernel(out@@AUX_ARGS@@).launch(grid=[1, 1, 1], block=[64, 1, 1])
'''
MASK_CALL = ("    keep = mask_mod_cute(b, h, q, kv, None, @@AUX@@)\n"
             "    out[tidx] = cutlass.Float32(1.0) if keep[0] else cutlass.Float32(0.0)")
SCORE_CALL = ("    s = cute.make_rmem_tensor(1, cutlass.Float32)\n    s[0] = cutlass.Float32(tidx) * 0.01\n"
              "    got = score_mod_cute(s.load(), b, h, q, kv, None, @@AUX@@)\n    out[tidx] = out[tidx] + got[0]\n"
              "    grad = score_mod_bwd_cute(got, s.load(), b, h, q_idx=q, kv_idx=kv, seqlen_info=None, "
              "aux_tensors=@@AUX@@)\n    out[tidx] = out[tidx] + grad[0]")


def compile_mods(folder: Path) -> tuple[int, int]:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    dtypes = {torch.int32: cutlass.Int32, torch.int8: cutlass.Int8, torch.float32: cutlass.Float32}
    ok = bad = 0
    for i, (mask, _, _) in enumerate(corpus()):
        mask = bind(mask, LENGTH, LENGTH, "cpu")
        captured = dict(captured_tensors(mask))
        try:
            mods, aux, _ = cute_mods(mask, captured)
            tables = [_aux_tensor(n, captured[n]) for n in aux]
            aux_list = "[" + ", ".join(f"a{j}" for j in range(len(aux))) + "]" if aux else "None"
            calls = [c for c, has in ((MASK_CALL, mask.mask_mod), (SCORE_CALL, mask.score_mod)) if has is not None]
            text = (HARNESS.replace("@@MODS@@", mods).replace("@@CALLS@@", "\n".join(calls))
                    .replace("@@AUX_PARAMS@@", "".join(f", a{j}: cute.Tensor" for j in range(len(aux))))
                    .replace("@@AUX_ARGS@@", "".join(f", a{j}" for j in range(len(aux)))).replace("@@AUX@@", aux_list))
            path = folder / f"mod_{i}.py"
            path.write_text(text)
            module = load_module(path, f"fa4_mod_{i}")
            fakes = [make_fake_compact_tensor(cutlass.Float32, (64,))]
            fakes += [make_fake_compact_tensor(dtypes[t.dtype], (max(1, t.numel()),)) for t in tables]
            t0 = time.time()
            cute.compile(module.launch, *fakes)
            ok += 1
            print(f"OK mod {mask.name} ({time.time() - t0:.1f} s)", flush=True)
        except Exception as exc:  # one line per case; the run goes on
            bad += 1
            print(f"FAIL mod {mask.name}: {type(exc).__name__}: {' | '.join(str(exc).split())[:600]}", flush=True)
    return ok, bad


def _files() -> list[tuple[str, Mask, int, int, int]]:
    w = torch.tensor([16, 64, 128, 256])
    bias = torch.randn(4, 32)

    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w[h])

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(q_idx - kv_idx, 0, 31)]

    return [("causal at other lengths", make("causal", q_len=256, kv_len=256), 4, 200, 333),
            ("softcap score only", make("softcap", q_len=256, kv_len=256), 4, 256, 256),
            ("per-head window + table bias", Mask("head_window_bias", mask_mod=head_window, score_mod=rel_bias), 4, 384, 384),
            ("image spans (.any())", make("image_spans", q_len=512, kv_len=512), 2, 512, 512),
            ("a window knob, turned", make("causal_sliding_window", {"window": 100}, q_len=256, kv_len=256), 2, 256,
             256)]


def compile_files(folder: Path) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    ok = bad = 0
    for label, mask, heads, q_len, kv_len in _files():
        try:
            src = fa4.generate(mask, mask.q_len or q_len, mask.kv_len or kv_len, heads=heads)
            module = fa4.load(fa4.write(src, folder))
            real = module._tensors("cpu")
            t0 = time.time()
            with FakeTensorMode(allow_non_fake_inputs=True):
                q = torch.empty(1, heads, q_len, 128, dtype=torch.bfloat16, device="cuda")
                k = torch.empty(1, heads, kv_len, 128, dtype=torch.bfloat16, device="cuda")
                # the stored tensors as fake CUDA tensors (their values do not matter to a compile)
                module._stored[str(q.device)] = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda")
                                                 for n, t in real.items()}
                out, lse = module.attention(q, k, k, return_lse=True)
                assert tuple(out.shape) == (1, heads, q_len, 128) and tuple(lse.shape) == (1, heads, q_len), \
                    (tuple(out.shape), tuple(lse.shape))
                if module.SCALARS:  # other values of every knob: the first compiles the knob-reading
                    # copies of the mods once, the next nothing new
                    from flash_attn.cute.interface import _flash_attn_fwd

                    compiled = len(_flash_attn_fwd.compile_cache.cache)
                    assert compiled > 0
                    for turn in (3, 5):
                        module.attention(q, k, k, scalars={n: v * turn / 2 if isinstance(v, float) else v + turn
                                                           for n, v in module.SCALARS.items()})
                        assert len(_flash_attn_fwd.compile_cache.cache) == compiled + 1, \
                            f"after turning the knobs to a {'first' if turn == 3 else 'second'} value, FA4 holds " \
                            f"{len(_flash_attn_fwd.compile_cache.cache) - compiled} new kernels, not 1"
                # the backward: FA4's own, with the generated score_mod derivative and the transposed lists
                # (what the file's autograd call runs; torch's autograd engine cannot run fake CUDA
                # tensors without CUDA, so FA4's backward entry is called as its autograd Function does)
                from flash_attn.cute.interface import _flash_attn_bwd

                from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

                aux = module._aux(q.device)
                blocks_bwd = None
                if module.HAS_MASK:  # the transposed lists' shapes (their values: test_fa4.py checks _transposed)
                    rows, cols = -(-q_len // 128), -(-kv_len // 128)
                    h_tab = heads if module.MASK_READS_HEAD else 1
                    cnt, idx = ((1, h_tab, cols), (1, h_tab, cols, rows))
                    blocks_bwd = BlockSparseTensorsTorch(*(torch.empty(shape, dtype=torch.int32, device="cuda")
                                                           for shape in (cnt, idx, cnt, idx)), block_size=(128, 128))
                mask_mod, score_mod, score_mod_bwd, read = module._mods(module._scalars(None, q_len, kv_len))
                qt, kt = q.transpose(1, 2), k.transpose(1, 2)
                o = torch.empty(qt.shape, dtype=qt.dtype, device="cuda")
                dq, dk, dv = _flash_attn_bwd(
                    qt, kt, kt, o, torch.empty_like(o), torch.empty(1, heads, q_len, device="cuda"), None, False, 0.0,
                    score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux,
                    aux_scalars=module._dsl_scalars(read), block_sparse_tensors=blocks_bwd)[:3]
                assert dq.shape == qt.shape and dk.shape == kt.shape
            ok += 1
            print(f"OK file {label} (forward + backward, {time.time() - t0:.1f} s)", flush=True)
        except Exception as exc:
            bad += 1
            print(f"FAIL file {label}: {type(exc).__name__}: {' | '.join(str(exc).split())[:600]}", flush=True)
    return ok, bad


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    try:
        import cutlass.cute  # noqa: F401
        import flash_attn.cute  # noqa: F401
    except ImportError as exc:
        print(f"NO FA4: {exc}")
        return 3
    folder = Path(tempfile.mkdtemp(prefix="fa4_compile_"))
    ok = bad = 0
    if what in ("mods", "all"):
        a, b = compile_mods(folder)
        ok, bad = ok + a, bad + b
    if what in ("files", "all"):
        a, b = compile_files(folder)
        ok, bad = ok + a, bad + b
    print(f"SUMMARY {ok} compiled, {bad} failed")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
