"""The port's Hopper kernel (templates/hopper.py, Gluon) compiled for sm_90a on a machine without a
GPU: Triton's compiler runs against a stand-in driver that names the target (no launch), then
ptxas reports the kernel's registers and spills (and, for masks without a score_mod, those of the
backward's two kernels, templates/hopper_backward.py). For each mask: the library at 1,024 tokens, and
users' mods (per-head and per-sample tables, spans with .any(), and_masks, documents, a softcap). Usage:

    python tests/run_hopper_compile.py [--quick] [NAME ...]

--quick compiles only the forms a call takes by default (the "auto" loop, the keys-down backward),
not every form a switch can choose (the default test suite; the slow suite compiles them all).

Prints `CASE <mask> OK|FAIL <registers, spills, shared memory>` per mask, then a SUMMARY line;
exits 1 on any failure. It never runs the kernel: whether it computes attention is for a GPU
(tests/test_gpu_port.py)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workbench import Mask, make, port, with_score  # noqa: E402


class _Target:
    """Stands in for the CUDA driver: an sm_90 target, device 0, stream 0; nothing launches."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _spill_bytes(report: str) -> int:
    """The spill stores' bytes in one ptxas report line."""
    import re

    found = re.search(r"(\d+) bytes spill stores", report)
    return int(found.group(1)) if found else 1 << 30


def ptxas(kernel) -> str:
    """registers, spill stores / loads, as ptxas -v reads them off the kernel's PTX."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    done = subprocess.run([str(tool), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                          text=True)
    lines = [ln.split("info    :")[-1].strip() for ln in done.stderr.splitlines() if "registers" in ln or "spill" in ln]
    if done.returncode:
        raise RuntimeError(done.stderr[-500:])
    return "; ".join(lines)


def sass_of(kernel, words: bool = False) -> str:
    """A compiled kernel's SASS for sm_90a: ptxas on its PTX, then nvdisasm (both from Triton's own
    bundle); words: with each instruction's two 64-bit words (nvdisasm -hex: the second, on a line of
    its own, holds the control bits ptxas scheduled it with)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = Path(folder) / "k.ptx", Path(folder) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        subprocess.run([str(bin_dir / "ptxas"), "--gpu-name=sm_90a", str(ptx), "-o", str(cubin)], check=True,
                       capture_output=True)
        return subprocess.run([str(bin_dir / "nvdisasm"), "-c", *(["-hex"] if words else []), str(cubin)], check=True,
                              capture_output=True, text=True).stdout


def stand_in(module, B: int = 2, H: int = 4, L: int = 1024, D: int = 128):
    """(q, k, v, tables) of zeros for compiling `module`'s Hopper kernel without a GPU: bf16, H query
    and 2 kv heads, L tokens. The block lists come from a scan kernel that would launch, so the
    module gets int32 lists of their shapes, and the persistent form an H100's / H200's 132 SMs."""
    q, k, v = (torch.zeros(B, H if i == 0 else 2, L, D, dtype=torch.bfloat16) for i in range(3))
    rows = cols = L // 128
    module._SM_COUNTS[q.device] = 132
    module.block_lists = lambda *a, **kw: (torch.zeros(rows, dtype=torch.int32),
                                           torch.zeros(rows, cols, dtype=torch.int32),
                                           torch.zeros(rows, dtype=torch.int32),
                                           torch.zeros(rows, cols, dtype=torch.int32))
    return q, k, v, module._tables(q.device, L, L)


def exponentials_before_waits(kernel) -> list[int]:
    """For each full wait on the warpgroup MMAs (WARPGROUP.DEPBAR.LE gsb0, 0x0) in the kernel's SASS
    (ptxas, then nvdisasm): how many exponentials (MUFU.EX2) run between the last MMA issued and
    that wait. A loop whose softmax runs under the previous tile's P V has all of a tile's there."""
    import re

    sass = sass_of(kernel)
    counts, last_mma, exps = [], None, 0
    for line in sass.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)
        if "HGMMA" in line:
            last_mma, exps = line, 0
        elif "MUFU.EX2" in line:
            exps += 1
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and last_mma is not None:
            counts.append(exps)
    return counts


def masks(device: str = "cpu") -> list[Mask]:
    """The compiled masks, their captured tensors on `device` (the GPU test runs them there)."""
    heads_w = torch.tensor([64, 128, 256, 1024], device=device)
    lens = torch.tensor([300, 1024], device=device)
    spans = torch.tensor([[100, 300], [600, 700]], device=device)

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < heads_w[h])

    def per_sample_prefix(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < lens[b])

    def image_spans(b, h, q_idx, kv_idx):
        both = ((q_idx[..., None] >= spans[:, 0]) & (q_idx[..., None] < spans[:, 1])
                & (kv_idx[..., None] >= spans[:, 0]) & (kv_idx[..., None] < spans[:, 1]))
        return (kv_idx <= q_idx) | both.any(-1)

    from torch.nn.attention.flex_attention import and_masks

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    relative = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(device)

    def score_biases(score, b, h, q_idx, kv_idx):  # (ALiBi as attention-gym writes it, a relative table)
        return score + slopes[h] * (kv_idx - q_idx) + relative[h, (q_idx - kv_idx).clamp(0, 15)]

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 200

    return [Mask("users_and_masks", mask_mod=and_masks(causal, near)), make("causal"), make("full"),
            make("causal_sliding_window", {"window": 256}),
            make("document", {"doc_lengths": [300, 400, 324]}, q_len=1024, kv_len=1024, device=device),
            with_score(make("causal"), make("softcap")),
            with_score(make("causal"), make("alibi", {"num_heads": 4}, device=device)),
            Mask("users_head_window", mask_mod=head_window), Mask("users_per_sample_prefix", mask_mod=per_sample_prefix),
            Mask("users_image_spans", mask_mod=image_spans),
            # (its window checks folded into one unsigned compare: translate/fast_mask.py)
            make("neighborhood_2d", {"kernel": 7}, q_len=1024, kv_len=1024),
            # (biases added to the score: one fused multiply-add in base 2, distances converted per
            # row and column: translate/fast_score.py)
            Mask("users_score_biases", mask_mod=causal, score_mod=score_biases)]


def main(argv) -> int:
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    driver.set_active(_Target())
    folder = Path(tempfile.mkdtemp(prefix="hopper_compile_"))
    failed = total = 0
    for mask in masks():
        if argv and mask.name not in argv:
            continue
        total += 1
        try:
            module = port.load(port.build(mask, 1024, 1024, heads=4, batch=2, out_dir=folder / mask.name))
            if module.HOPPER_MODS is not None:
                raise RuntimeError(f"no Gluon copy of the mods: {module.HOPPER_MODS}")
            B, H, L, D = 2, 4, 1024, 128
            q, k, v, tables = stand_in(module, B, H, L, D)
            details = []
            for loop in ("auto", ) if quick else ("specialized", "pingpong", "persistent"):  # (HOPPER_LOOP)
                module.HOPPER_LOOP = loop
                grid, args, options, _, _, _ = module._hopper_launch(q, k, v, D ** -0.5, True, tables)
                kernel = module._hopper_kernel().warmup(*args, grid=grid, **options)
                # (HOPPER_NAMED, off by default: the two warpgroups' turns and the buffers they give
                # back through named barriers, bar.arrive, in the ping-pong and persistent loops)
                named = module._hopper_loop() != "specialized" and bool(module.HOPPER_NAMED)
                assert ("bar.arrive" in kernel.asm["ptx"]) == named, (module._hopper_loop(), module.HOPPER_NAMED)
                # (HOPPER_UNDER_PV = 1) the steady loop's wait for the previous tile's P V comes after
                # the tile's 64 exponentials a thread computes (64 rows x 128 keys over 128 threads), not
                # before them, where ptxas puts it without the softmax's own block (--quick: two masks)
                if not quick or mask.name in ("users_image_spans", "causal_bottom_right+softcap_30"):
                    default_under, module.HOPPER_UNDER_PV = module.HOPPER_UNDER_PV, 1
                    grid, args, options, _, _, _ = module._hopper_launch(q, k, v, D ** -0.5, True, tables)
                    under = exponentials_before_waits(module._hopper_kernel().warmup(*args, grid=grid, **options))
                    module.HOPPER_UNDER_PV = default_under
                    assert max(under) >= 64, f"{module._hopper_loop()}: exponentials before each P V wait: {under}"
                    # (HOPPER_UNDER_PV = 2) the wait after the row max: only the two rows' alpha before it
                    module.HOPPER_UNDER_PV = 2
                    grid, args, options, _, _, _ = module._hopper_launch(q, k, v, D ** -0.5, True, tables)
                    after_max = exponentials_before_waits(module._hopper_kernel().warmup(*args, grid=grid, **options))
                    module.HOPPER_UNDER_PV = default_under
                    assert 2 <= max(after_max) < 64, \
                        f"{module._hopper_loop()}: exponentials before each P V wait after the max: {after_max}"
                details.append(f"{module._hopper_loop()}: {ptxas(kernel)}; shared {kernel.metadata.shared} bytes")
            # (HOPPER_TILE_INFO, HOPPER_FAST_STORE: on by default; both settings compiled here) the persistent loop
            # with the tile counts handed over by the load warp loads fewer words from global memory, and
            # its store divides once per row, not per element
            if not quick or mask.name == "users_image_spans":  # (--quick: the users' .any() spans)
                module.HOPPER_LOOP = "persistent"
                kept = module.HOPPER_TILE_INFO, module.HOPPER_FAST_STORE
                kernels = []
                for switches in ((0, 0), (1, 1)):
                    module.HOPPER_TILE_INFO, module.HOPPER_FAST_STORE = switches
                    grid, args, options, _, _, _ = module._hopper_launch(q, k, v, D ** -0.5, True, tables)
                    kernels.append(module._hopper_kernel().warmup(*args, grid=grid, **options))
                module.HOPPER_TILE_INFO, module.HOPPER_FAST_STORE = kept
                (plain, switched) = (kernel.asm["ptx"] for kernel in kernels)
                assert switched.count("ld.global") < plain.count("ld.global"), "the tile counts are still loaded"
                assert switched.count("div.") < plain.count("div.") // 4, (switched.count("div."), plain.count("div."))
                # (the persistent loop's own rule below: at most 192 bytes; a score_mod's biases spill 4)
                assert _spill_bytes(ptxas(kernels[1])) <= max(192, _spill_bytes(ptxas(kernels[0]))), ptxas(kernels[1])
                details.append(f"persistent, tile counts handed over and a reciprocal store: {ptxas(kernels[1])}")
            if not quick:  # (HOPPER_Q_BUFFERS = 2: the persistent loop's two buffers of queries, a ring of 2)
                module.HOPPER_LOOP, module.HOPPER_Q_BUFFERS = "persistent", 2
                grid, args, options, _, _, _ = module._hopper_launch(q, k, v, D ** -0.5, True, tables)
                kernel = module._hopper_kernel().warmup(*args, grid=grid, **options)
                assert options["Q_BUF"] == 2 and kernel.metadata.shared <= 227 * 1024, (options, kernel.metadata.shared)
                details.append(f"persistent, 2 query buffers: {ptxas(kernel)}; shared {kernel.metadata.shared} bytes")
                module.HOPPER_Q_BUFFERS = 1
            # lengths off the 128 grid (HOPPER_RAGGED): the masked store and the last key tile
            # loaded from Lk - BLOCK_N, in the form "auto" picks for this mask
            module.HOPPER_LOOP, module.HOPPER_RAGGED = "auto", True
            q_odd, kv_odd = torch.zeros(B, H, 1000, D, dtype=torch.bfloat16), torch.zeros(B, 2, 1011, D, dtype=torch.bfloat16)
            grid, args, options, _, _, _ = module._hopper_launch(q_odd, kv_odd, kv_odd, D ** -0.5, True,
                                                              module._tables(q.device, 1000, 1011))
            assert options.get("EVEN_M") is False and options.get("EVEN_N") is False and grid[0] * (grid[1] if len(grid) > 1 else 1) == 64, (grid, options)
            kernel = module._hopper_kernel().warmup(*args, grid=grid, **options)
            details.append(f"1000 x 1011 ({module._hopper_loop()}): {ptxas(kernel)}")
            # attention_paged's prefill (templates/hopper_paged.py): pages of 16 keys (a TMA copy per
            # page into a slice of the 128-key buffer) and of 128 (one copy a tile), and its lists kernel
            total_q, slots = 300, 300 // 128 + 2
            qp = torch.zeros(total_q, H, D, dtype=torch.bfloat16)
            heads = H if module.MASK_READS_HEAD else 1
            plan = (torch.zeros(slots, 8, dtype=torch.int32), torch.zeros(slots * heads, 3, dtype=torch.int32),
                    torch.zeros(slots * heads, 8, dtype=torch.int32), torch.zeros(slots * heads, 8, dtype=torch.int32))
            pointers = [tables[n] for n in module.ALL_POINTERS]
            for page in (16, ) if quick else (16, 128):  # (an int64 block table at page 128)
                cache = torch.zeros(1024 // page * 2, page, 2, D, dtype=torch.bfloat16)
                table = torch.zeros(2, 1024 // page, dtype=torch.int32 if page == 16 else torch.int64)
                grid, args, options = module._hopper_paged_launch(qp, cache, cache, table, D ** -0.5, True, pointers,
                                                                  plan, qp, qp)
                kernel = module._hopper_paged_kernel.warmup(*args, grid=grid, **options)
                details.append(f"paged {page} ({module._hopper_paged_loop()}): {ptxas(kernel)}")
            ranges = [torch.zeros(3, dtype=torch.int64)] * len(module.MASK_POINTERS) if module.HAS_BOUNDS else []
            table = torch.zeros(2, 64, dtype=torch.int32)
            lists = module._hopper_paged_lists.warmup(
                torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), table, table.stride(0), *plan, 8,
                2, total_q, 1 << 30, 1 << 30, 1024, 16, *pointers, *ranges, BOUNDS=module.HAS_BOUNDS and module.HAS_MASK,
                PAGE_SIZE=16, PAGES=8, BLOCK=128, grid=(slots, heads))
            details.append(f"paged lists: {ptxas(lists)}")
            if mask.score_mod is None:  # the backward's two kernels (templates/hopper_backward.py), at D 64
                d = 64
                qb, kb = torch.zeros(B, H, L, d, dtype=torch.bfloat16), torch.zeros(B, 2, L, d, dtype=torch.bfloat16)
                module.column_lists = module.block_lists
                rows_f = torch.zeros(B, H, L, dtype=torch.float32)
                # (HOPPER_BWD_FUSED_DQ: dq by atomic adds in the dk / dv kernel; 3: by TMA reduce-adds)
                forms = (0, 1, 2, 3) if module._HAS_TMA_REDUCE else (0, 1, 2)
                for fused in forms[-1:] if quick else forms:
                    *_, launches = module._hopper_bwd_plan(qb, kb, kb, qb, rows_f, rows_f, d ** -0.5, tables,
                                                           fused=fused)
                    for kernel, grid, args, options, *_ in launches:
                        compiled = kernel.warmup(*args, grid=grid, **options)
                        reduces = "cp.reduce.async.bulk.tensor" in compiled.asm["ptx"]
                        assert reduces == (fused == 3), f"form {fused}: TMA reduce-adds in the PTX: {reduces}"
                        details.append(f"backward D {d}{f' fused dq {fused}' if fused else ''} {kernel.fn.__name__}: "
                                       f"{ptxas(compiled)}")
                # D 128's fused forms split dQ's matmul between the warpgroups (HOPPER_BWD_DQ_SPLIT_HEAD_DIMS)
                qb, kb = torch.zeros(B, H, L, 128, dtype=torch.bfloat16), torch.zeros(B, 2, L, 128, dtype=torch.bfloat16)
                forms = (2, 3) if module._HAS_TMA_REDUCE else (2, )
                for fused in forms[-1:] if quick else forms:
                    *_, launches = module._hopper_bwd_plan(qb, kb, kb, qb, rows_f, rows_f, 128 ** -0.5, tables,
                                                           fused=fused)
                    (kernel, grid, args, options, *_), = launches
                    # (form 3 keys down, HOPPER_BWD_SPLIT_KEYS_DOWN; form 2 queries down)
                    assert options["KEYS_SPLIT"] == (fused == 3) and options["DQ_SPLIT"] == (fused == 2), options
                    compiled = kernel.warmup(*args, grid=grid, **options)
                    reduces = "cp.reduce.async.bulk.tensor" in compiled.asm["ptx"]
                    assert reduces == (fused == 3), f"split form {fused}: TMA reduce-adds in the PTX: {reduces}"
                    # (keys down, the hand-off's named barriers: the math warpgroups' bar.arrive to the dQ warp)
                    named = "bar.arrive" in compiled.asm["ptx"]
                    assert named == (fused == 3), f"split form {fused}: named barriers in the PTX: {named}"
                    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
                    details.append(f"backward D 128 split dq {fused}: {ptxas(compiled)}")
            elif module._HAS_TMA_REDUCE and module.HOPPER_GRAD is None:  # a score_mod: the keys-down form
                module.column_lists = module.block_lists
                rows_f = torch.zeros(B, H, L, dtype=torch.float32)
                for d in (64, 128):
                    qb, kb = torch.zeros(B, H, L, d, dtype=torch.bfloat16), torch.zeros(B, 2, L, d, dtype=torch.bfloat16)
                    *_, launches = module._hopper_bwd_plan(qb, kb, kb, qb, rows_f, rows_f, d ** -0.5, tables, fused=3)
                    (kernel, grid, args, options, *_), = launches
                    assert options["KEYS_SPLIT"] and options["HAS_SCORE"], options
                    compiled = kernel.warmup(*args, grid=grid, **options)
                    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
                    details.append(f"backward D {d} keys down with the score_mod: {ptxas(compiled)}")
            detail = " | ".join(details)
            # no spills at whole blocks; lengths off the grid may spill a little where a mask is heavy
            # (a user's .any() spans: 92 bytes in the ping-pong loop, 168 in the persistent one that
            # "auto" takes: scalars, the tables' pointers and indices), and so may the persistent
            # loop, which carries its tile walk's scalars too (12 bytes for a window or documents)
            # (the backward's dk / dv kernel keeps dK and dV in registers and spills some at its
            # fastest tile: reported, not failed)
            spilled = [d for d in details if " 0 bytes spill stores" not in d and not d.startswith(("backward", "paged"))
                       and not (d.startswith(("1000 x 1011", "persistent")) and _spill_bytes(d) <= 192)]
            problem = f"spills: {detail}" if spilled else None
        except Exception as exc:
            problem, detail = f"{type(exc).__name__}: {str(exc)[:400]}", ""
        failed += problem is not None
        print(f"CASE {mask.name} {'OK ' + detail if problem is None else 'FAIL ' + problem}", flush=True)
    print(f"SUMMARY {total - failed}/{total} masks' Hopper kernels compile for sm_90a without spills (the backward's "
          "reported; lengths off the 128 grid and the persistent loop: at most 192 bytes)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
