"""Command line: composes the stages; holds no logic of its own.

    python -m workbench list
    python -m workbench report [TARGET ...] [--param k=JSON ...] -o DIR
    python -m workbench blocks TARGET [--param k=JSON ...] --q-len N --kv-len M [-o DIR] [--json] [--engine E]
    python -m workbench verify TARGET [--param k=JSON ...] [--score TARGET] --q-len N [--backward] [--json]
    python -m workbench export TARGET [--param k=JSON ...] [--score TARGET] --q-len N -o DIR
    python -m workbench port TARGET [--param k=JSON ...] [--score TARGET] --q-len N -o DIR
    python -m workbench invariance TARGET [--param k=JSON ...] --q-len N [--backend flex|port|eager] [--hold L ...]
    python -m workbench invariance TARGET --q-len N --backend port --serving
    python -m workbench sweep SWEEP.toml [-o DIR] [--address ADDR] [--resume] [--cpus N] [--gpus N]
    python -m workbench conformance DIR/NAME.spec.json --impl path.py:function
    python -m workbench diff A.spec.json B.spec.json

A TARGET is a library name (see `list`) or path/to/file.py:factory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workbench import invariance, look, port, sweep
from workbench.analyze import mask_stats
from workbench.blocks import scan_blocks
from workbench.define import WorkbenchError, check_device, factory_params, library, output_folder, parse_params, prepare
from workbench.define import make as make_mask
from workbench.export import build_spec, conformance, diff_specs, write_spec
from workbench.invariance import BACKENDS, LAYOUT_KEYS
from workbench.report import DEFAULT_LEN, default_device, library_targets, run_report
from workbench.run import FlexBackend, Shape, check_mask_fits, dtype_name
from workbench.verify import ReferenceOptions, verify

__all__ = ["main", "build_parser"]


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (0 or a negative is an error, never a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (sizes are >= 1)")
    return value


def count(text: str) -> int:
    """argparse type: a whole number >= 0 (a GPU count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a whole number >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give a whole number >= 0")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a positive number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _add_target_args(p: argparse.ArgumentParser, many: bool = False):
    if many:
        p.add_argument("targets", nargs="*", metavar="TARGET",
                       help="library names or path/to/file.py:factory (default: the whole library)")
    else:
        p.add_argument("target", metavar="TARGET", help="library name or path/to/file.py:factory")
    p.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                   help="factory parameter; the value is parsed as JSON, else taken as a string (repeatable)")
    p.add_argument("--score", metavar="TARGET", help="add this score_mod target (e.g. softcap, alibi)")
    p.add_argument("--score-param", action="append", default=[], metavar="KEY=JSON",
                   help="parameter of the --score target (repeatable)")


def _add_size_args(p: argparse.ArgumentParser, required: bool):
    p.add_argument("--q-len", type=positive_int, required=required, help="query length")
    p.add_argument("--kv-len", type=positive_int, help="key/value length (default: --q-len)")
    p.add_argument("--heads", type=positive_int, help="number of heads (default: broadcast, or what the mask needs)")
    p.add_argument("--batch", type=positive_int, help="batch size (default: broadcast)")
    p.add_argument("--block-size", type=positive_int, nargs="+", default=[128], metavar="S",
                   help="block size, or Q_BLOCK KV_BLOCK (default 128)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="the built-in masks, one per line", description="List the built-in mask library.")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("report", help="analyze masks and write an HTML report (the main job)",
                       description="Run the workbench over masks and write DIR/report.html, summary.json, summary.csv.")
    _add_target_args(p, many=True)
    _add_size_args(p, required=False)
    p.add_argument("-o", "--out", default="out", help="output folder (default: out)")
    p.add_argument("--timeout", type=positive_float, default=900.0, metavar="SECONDS",
                   help="give up on a mask after this long and go on with the others (default 900)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="processes analyzing masks side by side (default: several on a GPU, where a mask's time "
                        "is mostly compiling; 1 on a CPU)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("blocks", help="block statistics and pictures of one mask",
                       description="Build the block mask of TARGET exactly, print its statistics, write pictures to DIR.")
    _add_target_args(p)
    _add_size_args(p, required=True)
    p.add_argument("-o", "--out", help="write block_map.png, overview.png, token_view.png here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--engine", choices=["eager", "triton", "compiled"],
                   help="how to count blocks (default: picked; triton = one fused kernel, CUDA only)")
    p.set_defaults(func=cmd_blocks)

    p = sub.add_parser("verify", help="FlexAttention vs an eager float64 reference",
                       description="Run TARGET through compiled FlexAttention on random inputs and compare out, lse "
                                   "(and with --backward dq, dk, dv) with an eager float64 reference. Exit 1 on failure.")
    _add_target_args(p)
    _add_size_args(p, required=True)
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads for grouped-query attention (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dimension (default 64)")
    p.add_argument("--dtype", default="bfloat16", help="float32, tf32, bfloat16, float16 (CUDA); float32, "
                                                       "float64, bfloat16, float16 (CPU). Default bfloat16")
    p.add_argument("--backward", action="store_true", help="also check dq, dk, dv and learnable tables' gradients "
                   "(flex: CUDA only; port: any device, on a CPU under Triton's interpreter)")
    p.add_argument("--seed", type=int, help="input seed (default: a fresh one, printed)")
    p.add_argument("--eager", action="store_true", help="run flex_attention without torch.compile")
    p.add_argument("--backend", choices=["flex", "port", "port-paged", "port-paged-invariant", "fa4"], default="flex",
                   help="judge FlexAttention (default), the generated Triton port (`workbench port`), the "
                        "port's attention_paged over a shuffled paged KV cache (port-paged; in invariant mode: "
                        "port-paged-invariant), or the FA4 export on FlashAttention-4 (fa4: CUDA, flash-attn-4)")
    p.add_argument("--workers", type=positive_int, help="split the float64 reference by query rows across this many "
                                                        "Ray workers (one GPU each on a GPU machine)")
    p.add_argument("--address", help="with --workers: join this Ray cluster (default: a local Ray)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("port", help="generate a standalone Triton attention kernel for a mask",
                       description="Write DIR/NAME_KEY_attention.py (and its tensors): attention under TARGET's mask and "
                                   "score as one Triton kernel that imports only torch and triton. The port is then "
                                   "verified against the float64 reference and, on a GPU, timed against compiled "
                                   "FlexAttention.")
    _add_target_args(p)
    _add_size_args(p, required=True)
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads of the check (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dimension of the check (default 64)")
    p.add_argument("--dtype", help="dtype of the check (default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--seed", type=int, help="input seed of the check")
    p.add_argument("--no-verify", action="store_true", help="only write the file")
    p.add_argument("-o", "--out", required=True, help="output folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_port)


    p = sub.add_parser("invariance", help="does one request get the same bits alone, batched, packed, chunked?",
                       description="Compute one request of --q-len tokens alone and under other layouts (batch "
                                   "positions, packed after another request at block-aligned and unaligned offsets, "
                                   "kv padding, chunked prefill, decode of its last rows, run to run) and compare its "
                                   "rows bit for bit. Exit 1 if a layout named by --hold (default: all) differs.")
    _add_target_args(p)
    p.add_argument("--q-len", type=positive_int, required=True, help="the request's length")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dimension (default 128)")
    p.add_argument("--batch", type=positive_int, default=8, help="batch size of the batched layouts (default 8)")
    p.add_argument("--block-size", type=positive_int, default=128, help="FlexAttention's block size (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--backend", choices=list(BACKENDS), default="flex",
                   help="flex (compiled on a GPU), eager (FlexAttention uncompiled) or port (the generated Triton "
                        "kernel)")
    p.add_argument("--hold", nargs="+", choices=list(LAYOUT_KEYS), metavar="LAYOUT",
                   help=f"layouts that must be bitwise (default: all): {', '.join(LAYOUT_KEYS)}")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUT_KEYS), metavar="LAYOUT",
                   help="run only these layouts (default: all)")
    p.add_argument("--segments", action="store_true",
                   help="with --backend port: run packed layouts with cu_seqlens (tiles from each request's start)")
    p.add_argument("--serving", action="store_true",
                   help="with --backend port: the serving layouts of attention_paged instead (in a step with other "
                        "requests, shuffled pages, page sizes 16 / 128, split-KV on / off, chunked prefill, token by "
                        "token decode), invariant mode against attention(invariant=True) and fast mode against the "
                        "request alone; exit 1 unless invariant mode is bitwise everywhere")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_invariance)

    p = sub.add_parser("sweep", help="a grid of masks x lengths x dtypes x tasks on Ray",
                       description="Run every case of a sweep file (TOML; see examples/sweep_small.toml) as one Ray "
                                   "task and write DIR/results.parquet, results.csv and summary.html. A local Ray "
                                   "starts unless --address names a cluster. Exit 1 if a case failed.")
    p.add_argument("sweep", help="the sweep file (.toml)")
    p.add_argument("-o", "--out", default="out/sweep", help="output folder (default: out/sweep)")
    p.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    p.add_argument("--resume", action="store_true", help="skip the cases already in DIR (nothing runs twice)")
    p.add_argument("--cpus", type=positive_int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--gpus", type=count, help="GPUs of the local Ray (default: all)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("export", help="write the porting spec and golden vectors of a mask",
                       description="Write DIR/NAME-DIGEST.spec.json and DIR/NAME-DIGEST.golden.safetensors: every "
                                   "backend form that reproduces TARGET exactly, the reasons for the others, and "
                                   "float64 golden outputs.")
    _add_target_args(p)
    _add_size_args(p, required=True)
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dimension of the golden vectors (default 64)")
    p.add_argument("--seed", type=int, help="seed of the golden inputs (default: a fresh one, recorded)")
    p.add_argument("-o", "--out", required=True, help="output folder")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("conformance", help="run an implementation on a spec's golden vectors",
                       description="Call FUNCTION(q, k, v, spec) -> out on each golden vector of SPEC and compare with "
                                   "the float64 reference. Exit 0 only if every vector passes.")
    p.add_argument("spec", help="NAME.spec.json")
    p.add_argument("--impl", required=True, metavar="path.py:function", help="the candidate implementation")
    p.add_argument("--device", default="cpu", help="device for q, k, v (default cpu)")
    p.add_argument("--dtype", help="judge with this dtype's tolerance (default: the dtype the function returns)")
    p.add_argument("--timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="fail a vector whose call has not returned after this long (default 300)")
    p.add_argument("--backward", action="store_true",
                   help="also judge dq, dk, dv: FUNCTION's autograd (a generated port's own backward) for each "
                        "vector's grad_out")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_conformance)

    p = sub.add_parser("diff", help="do two specs describe the same attention",
                       description="Compare two porting specs pair by pair; exit 0 if they are the same, 1 if not.")
    p.add_argument("a", help="A.spec.json")
    p.add_argument("b", help="B.spec.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_diff)
    return parser


def _device(args) -> str:

    return str(check_device(args.device or default_device()))


def _block_size(args):
    sizes = args.block_size
    if len(sizes) not in (1, 2):
        raise WorkbenchError("--block-size takes one or two numbers", "e.g. --block-size 128 or --block-size 128 64")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)


def _check_score_args(args) -> None:
    if getattr(args, "score_param", None) and not getattr(args, "score", None):
        raise WorkbenchError("--score-param needs --score (the score target the parameters are for)",
                             "add e.g. --score softcap, or drop --score-param")


def load_mask(args, q_len: int, kv_len: int, device: str, target: str | None = None):
    return prepare(target or args.target, parse_params(args.param), q_len, kv_len, device, score=args.score,
                   score_params=parse_params(args.score_param), heads=getattr(args, "heads", None),
                   batch=getattr(args, "batch", None))


def cmd_list(_args) -> int:

    for name, factory in library().items():
        try:
            summary = make_mask(factory).summary
        except WorkbenchError as exc:
            summary = f"(fails with defaults: {exc.message})"
        params = factory_params(factory)
        shown = ", ".join(f"{k}={json.dumps(v)}" + (" (picked from the lengths)" if v is None else "")
                          for k, v in params.items()) or "no parameters"
        print(f"{name:24s} {summary}\n{'':24s} parameters: {shown}")
    return 0


def cmd_report(args) -> int:

    params = parse_params(args.param)
    targets = [(t, params) for t in args.targets] if args.targets else library_targets()
    if params and not args.targets:
        raise WorkbenchError("--param needs a TARGET", "name the mask the parameters are for")
    _check_score_args(args)
    results = run_report(targets, args.out, q_len=args.q_len or DEFAULT_LEN, kv_len=args.kv_len,
                         heads=args.heads if args.heads else 4, batch=args.batch, block_size=_block_size(args),
                         device=_device(args), timeout=args.timeout, workers=args.workers)
    failed = [r for r in results if r.error]
    for r in failed:
        print(f"error: {r.error}", file=sys.stderr)
    print(f"wrote {Path(args.out) / 'report.html'} ({len(results)} masks, {len(failed)} failed)")
    return 1 if failed else 0


def cmd_blocks(args) -> int:

    q_len, kv_len, device = args.q_len, args.kv_len or args.q_len, _device(args)
    mask = load_mask(args, q_len, kv_len, device)
    scan = scan_blocks(mask, q_len, kv_len, heads=args.heads or mask.heads, batch=args.batch,
                       block_size=_block_size(args), device=device, engine=args.engine)
    stats = mask_stats(scan)
    if args.out:

        out = output_folder(args.out, mask.name)
        look.png(look.block_map(scan, title=mask.name), out / "block_map.png", close=True)
        look.png(look.overview(mask, q_len, kv_len, device=device), out / "overview.png", close=True)
        where = look.focus(scan, 1024, mask=mask, device=device)
        look.png(look.token_view(mask, where.q_range, where.kv_range, device=device, why=where.reason),
                 out / "token_view.png", close=True)
    if args.json:
        record = stats.to_dict()
        record.update(name=mask.name, block_size=stats.block_size, seconds=round(scan.seconds, 4), device=device,
                      engine=scan.engine, evaluator=scan.evaluator)
        print(json.dumps(record))
    else:
        print(f"{mask.name}  ({scan.engine}, {scan.evaluator}, {scan.seconds:.3f} s on {device})")
        print(stats.to_frame().to_string())
        if args.out:
            print(f"pictures in {args.out}/")
    return 0


def cmd_verify(args) -> int:

    q_len, kv_len, device = args.q_len, args.kv_len or args.q_len, _device(args)
    mask = load_mask(args, q_len, kv_len, device)
    heads = args.heads or mask.heads or 1
    shape = Shape(batch=args.batch or 1, q_heads=heads, kv_heads=args.kv_heads or heads, q_len=q_len,
                  kv_len=kv_len, head_dim=args.head_dim)
    backend = args.backend if args.backend != "flex" else FlexBackend(compile=not args.eager,
                                                                      block_size=_block_size(args) or 128)
    verdict = verify(mask, shape, dtype=args.dtype, device=device, backward=args.backward, seed=args.seed,
                     backend=backend, reference=ReferenceOptions(workers=args.workers, address=args.address))
    if args.json:
        print(json.dumps(verdict.to_dict()))
    else:
        print(verdict.line)
        print(verdict.to_frame()[["max_abs_err", "rel_err", "worst", "bad_count", "nan_count", "passed"]].to_string())
        compile_s = "not compiled" if verdict.compile_seconds is None else f"compile {verdict.compile_seconds:.2f} s"
        print(f"{compile_s}, run {verdict.run_seconds * 1e3:.1f} ms, reference {verdict.reference_seconds:.2f} s "
              f"({verdict.reference_dtype}, scores of {verdict.reference_fraction:.1%} of the pairs: the keys the mask "
              "keeps, chunk by chunk)")
        for f in verdict.findings:
            print(f"{f.severity}: {f.kind}: {f.message}")
    return 0 if verdict.passed else 1


def cmd_sweep(args) -> int:

    frame = sweep.run(args.sweep, args.out, address=args.address, resume=args.resume, num_cpus=args.cpus,
                       num_gpus=args.gpus)
    ok = frame["ok"].fillna(False).astype(bool)
    passed = frame["passed"].fillna(False).astype(bool) if "passed" in frame else ok
    failed = frame[~(ok & passed)]
    for _, row in failed.iterrows():
        name = row["name"] if isinstance(row.get("name"), str) else row["target"]
        why = row["error"] or (row["line"] if isinstance(row.get("line"), str) else "a check failed")
        print(f"failed: {name} {row['task']} q_len={row['q_len']}: {why}", file=sys.stderr)
    print(f"{len(frame)} cases ({frame.attrs['ran']} run now, {frame.attrs['skipped']} from before), "
          f"{len(failed)} failed; results in {args.out}/results.parquet, summary in {args.out}/summary.html")
    return 1 if len(failed) else 0


def cmd_invariance(args) -> int:

    _check_score_args(args)
    device = _device(args)
    if args.serving:
        return _serving_invariance(args, device)
    mask = load_mask(args, args.q_len, args.q_len, device) if args.q_len >= 4 else args.target
    options = invariance.InvarianceOptions(batch=args.batch, block_size=args.block_size, seed=args.seed,
                                           segments=args.segments)
    result = invariance.check(mask, None if mask is not args.target else parse_params(args.param), q_len=args.q_len,
                              heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                              device=device, backend=args.backend, hold=args.hold, layouts=args.layouts,
                              options=options, progress=not args.json)
    return _show_invariance(result, args.json)


def _show_invariance(result, as_json: bool) -> int:
    """Print an invariance result (one JSON object, or its layouts' table, notes and verdict line)
    and give the exit status: 0 if it passed."""
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        import pandas as pd

        with pd.option_context("display.max_colwidth", 90, "display.width", 250):
            # last-bit differences print as such (1.79e-07), never as 0.000000 next to bitwise False
            print(result.to_frame()[["bitwise", "same_attention", "max_abs_diff", "max_ulp", "why"]].to_string(
                float_format=lambda x: f"{x:.3g}"))
        for note in getattr(result, "notes", []):
            print(f"note: {note}")
        print(result.line)
    return 0 if result.passed else 1


def _serving_invariance(args, device) -> int:
    from workbench import serving

    if args.backend != "port":
        raise WorkbenchError("--serving checks the generated port's attention_paged", "add --backend port")
    if args.hold or args.layouts or args.segments:
        raise WorkbenchError("--hold, --layouts and --segments choose contiguous layouts; --serving runs its own",
                             "drop them, or drop --serving")
    mask = load_mask(args, args.q_len, args.q_len, device) if args.q_len >= 8 else args.target
    result = serving.check(mask, None if mask is not args.target else parse_params(args.param), q_len=args.q_len,
                           heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                           device=device, seed=args.seed)
    return _show_invariance(result, args.json)


def cmd_port(args) -> int:

    q_len, kv_len, device = args.q_len, args.kv_len or args.q_len, _device(args)
    dtype = dtype_name(args.dtype) if args.dtype else None  # an unknown dtype is an error before any work
    port.check_supported(args.head_dim, None if args.no_verify else dtype)  # before anything is written
    mask = load_mask(args, q_len, kv_len, device)
    heads = args.heads or mask.heads or 1
    shape = Shape(batch=args.batch or 1, q_heads=heads, kv_heads=args.kv_heads or heads, q_len=q_len, kv_len=kv_len,
                  head_dim=args.head_dim)
    check_mask_fits(mask, shape)  # before anything is written
    result = port.check(mask, shape, device, dtype=dtype, out_dir=args.out, verify_it=not args.no_verify,
                        seed=args.seed, progress=None)
    if args.json:
        record = {"file": str(result.path), "tensor_file": result.source.tensor_file,
                  "valid_for": result.source.valid_for()}
        if result.verdict is not None:
            record["verify"] = result.verdict.to_dict()
        if result.timing:
            record["timing"] = result.timing
        if result.note:
            record["note"] = result.note
        print(json.dumps(record))
    else:
        print(result.line)
    return 0 if result.passed is not False else 1


def cmd_export(args) -> int:

    q_len, kv_len, device = args.q_len, args.kv_len or args.q_len, _device(args)
    mask = load_mask(args, q_len, kv_len, device)
    spec = build_spec(mask, q_len, kv_len, heads=args.heads or mask.heads, batch=args.batch, head_dim=args.head_dim,
                      block_size=_block_size(args), device=device, seed=args.seed, progress=True)
    json_path, st_path = write_spec(spec, args.out)
    if args.json:
        print(json.dumps({"spec": str(json_path), "tensors": str(st_path), "backends": spec.supported,
                          "unsupported": spec.unsupported, "pattern": spec.doc["pattern"], "score": spec.doc["score"]}))
        return 0
    print(f"wrote {json_path} and {st_path.name}")
    print(f"pattern: {spec.doc['pattern']['kind']} {json.dumps(spec.doc['pattern']['params'])[:200]}; "
          f"score: {spec.doc['score']['kind']}")
    print("exact on: " + ", ".join(spec.supported))
    for target, reason in spec.unsupported.items():
        print(f"not {target}: {reason}")
    return 0


def cmd_conformance(args) -> int:

    report = conformance(args.spec, args.impl, device=_device(args), dtype=args.dtype, timeout=args.timeout,
                         backward=args.backward)
    if args.json:
        print(json.dumps({"passed": report.passed, "spec": report.spec, "impl": report.impl, "vectors": report.rows}))
    else:
        print(report.line)
        print(report.to_frame().to_string())
    return 0 if report.passed else 1


def cmd_diff(args) -> int:
    from dataclasses import asdict


    d = diff_specs(args.a, args.b)
    if args.json:
        print(json.dumps({**asdict(d), "line": d.line}))
    else:
        print(d.line)
        for ex in d.examples:
            (q0, q1), (k0, k1) = ex["q"], ex["kv"]
            rows = f"q {q0}" if q1 == q0 + 1 else f"q {q0}..{q1 - 1}"
            keys = f"kv {k0}" if k1 == k0 + 1 else f"kv {k0}..{k1 - 1}"
            print(f"  b={ex['b']} h={ex['h']} {rows}, {keys}: kept only by {ex['kept_by']}")
    return 0 if d.same else 1


# optional packages and the extra of pyproject.toml that installs each
OPTIONAL = {"ray": "sweep", "pyarrow": "sweep", "fastparquet": "sweep", "triton": "dev", "anywidget": "dev",
            "playwright": "dev", "nbclient": "dev", "attn_gym": "dev"}


def optional_package(exc: ImportError) -> tuple[str, str] | None:
    """(package, extra) when `exc` is an optional package's absence (pandas' 'Unable to find a
    usable engine ... pyarrow' included), else None."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if name in OPTIONAL:
        return name, OPTIONAL[name]
    text = str(exc)
    if "pyarrow" in text and "engine" in text:
        return "pyarrow", "sweep"
    return None


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    try:
        _check_score_args(args)
        return args.func(args)
    except WorkbenchError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `workbench list | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: say so in one line, keep the traceback on request
        missing = optional_package(exc) if isinstance(exc, ImportError) else None
        if missing is not None:  # an optional package missing: name the extra that brings it
            package, extra = missing
            print(f"error: this needs {package}, which is not installed. Fix: pip install 'flex-workbench[{extra}]' "
                  f"(or pip install {package})", file=sys.stderr)
            return 2
        if os.environ.get("WORKBENCH_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        print(f"error: internal error in flex-workbench: {type(exc).__name__}: {first}. Fix: this is a bug; rerun "
              "with WORKBENCH_DEBUG=1 for the traceback and report it", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
