"""The tile loops of a compiled Hopper kernel and each loop's instruction mix, from its SASS: the
port's forward compiled for sm_90a on any machine (no GPU needed: Triton's compiler runs against a
stand-in driver, then ptxas and nvdisasm from Triton's own bundle), or any cubin compiled elsewhere
(FlashAttention-4's CuTe DSL keeps its kernels' with CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=...).

    python benchmarks/sass_loops.py --port [MASK] [--loop persistent] [--set HOPPER_LANE_SUMS=0 ...] [--order LINE]
    python benchmarks/sass_loops.py --cubin FILE [--order LINE]

A loop is the code between a label and a branch back to it. For every innermost loop that issues
warpgroup MMAs (HGMMA) it prints the lines it spans, its instructions, and the instructions of its straight
path (the loop less its longest forward branch: in the port's loop, the mask's work on a partial
block), the stall cycles ptxas wrote into the straight path's control bits (one warp's issue time
along it, scoreboard waits not counted; bf16 D 128: FlashAttention-4's Hopper loop 960 over 470
instructions, the port's 1,063 over 482 as generated and 1,142 over 480 with HOPPER_NAMED=0
HOPPER_UNDER_PV=0; a schedule, not a prediction of speed), the instructions after the straight
path's last exponential (and how many of them are FMUL: O's rescale left for after the MUFU unit is
done), with the count of each kind that a tile's softmax and matmuls are made of. --order LINE prints
the straight path of the loop that starts at LINE (as the table gives it) as a sequence (runs
of one kind counted), where the place of the waits, the exponentials and O's rescale can be read.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "SHFL", "BAR", "SYNCS", "WARPGROUP", "FSEL",
         "ISETP", "LDG")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+`\((\.L_x_\d+)\)")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)([^;]*);")
_WORD = re.compile(r"\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")  # (nvdisasm -hex: an instruction's 64-bit word)


def split_words(listing: str) -> tuple[str, dict]:
    """nvdisasm -hex's listing as the plain listing (its lines numbered as without -hex) and, for
    each instruction's line there, its control bits: the second word's bits 41-61 (Volta and later:
    the stall count in the low 4 bits, then yield, the scoreboards it sets and the ones it waits on)."""
    plain, control = [], {}
    for line in listing.splitlines():
        word = _WORD.match(line)
        if word and not line.split("/*")[0].strip():  # (a line of only the second word)
            if plain and _INSTRUCTION.match(plain[-1]):
                control[len(plain) - 1] = int(word.group(1), 16) >> 41
            continue
        plain.append(_WORD.sub("", line))
    return "\n".join(plain), control


@dataclass
class Loop:
    start: int  # the label's line
    end: int  # the line of the branch back to it
    ops: collections.Counter  # instruction kind -> count, the whole loop
    path: collections.Counter  # the same, less the loop's longest forward branch
    order: list = field(default_factory=list)  # the straight path: (kind with its modifiers, run length)
    # the stall counts ptxas wrote into the straight path's control bits: the cycles one warp waits
    # after each instruction before its next, so the path's issue time where every result a
    # scoreboard tracks (exponentials, shuffles, memory, the MMAs, barriers) comes at once; None
    # without the control bits (a listing without nvdisasm's -hex)
    stalls: int | None = None

    @property
    def size(self) -> int:
        return sum(self.ops.values())

    @property
    def path_size(self) -> int:
        return sum(self.path.values())

    @property
    def tail(self) -> tuple[int, int]:
        """(instructions, of them FMUL) on the straight path after its last exponential (MUFU.EX2):
        what a tile issues after the MUFU unit's last work (bf16 D 128: FlashAttention-4's Hopper loop,
        whose O's rescale runs among the exponentials, 6; the port's with HOPPER_UNDER_PV = 0, whose
        rescale follows them, 71, 64 of them FMUL; as generated, 13, none FMUL). (0, 0) without
        exponentials."""
        names = [name for name, count in self.order for _ in range(count)]
        last = max((i for i, name in enumerate(names) if name.startswith("MUFU.EX2")), default=None)
        if last is None:
            return 0, 0
        rest = names[last + 1:]
        return len(rest), sum(name == "FMUL" or name.startswith("FMUL.") for name in rest)


def _kinds(lines) -> collections.Counter:
    found = collections.Counter()
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m:
            found[m.group(2)] += 1
    return found


def _sequence(lines) -> list:
    runs: list = []
    for line in lines:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name = m.group(2) + m.group(3)
        if m.group(2) in ("BAR", "SYNCS", "WARPGROUP", "BRA", "HGMMA"):  # (where they wait, and on what)
            name = f"{(m.group(1) or '').strip()} {name} {m.group(4).strip()[:48]}".strip()
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return [tuple(r) for r in runs]


def loops(sass: str) -> list[Loop]:
    """The innermost loops of a SASS listing (nvdisasm's, with -hex or without) that issue warpgroup
    MMAs, shortest first."""
    sass, control = split_words(sass)
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    found = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if not m or m.group(1) not in labels or labels[m.group(1)] >= i:
            continue
        a = labels[m.group(1)]
        body = lines[a:i + 1]
        ops = _kinds(body)
        if not ops["HGMMA"]:
            continue
        skip = None  # the longest forward branch within the loop
        for j in range(a, i):
            f = _BRANCH.search(lines[j])
            if f and f.group(1) in labels and j < labels[f.group(1)] <= i:
                if skip is None or labels[f.group(1)] - j > skip[1] - skip[0]:
                    skip = (j, labels[f.group(1)])
        numbers = range(a, i + 1) if skip is None else [*range(a, skip[0] + 1), *range(skip[1], i + 1)]
        straight = [lines[n] for n in numbers]
        stalls = sum(control[n] & 15 for n in numbers if n in control) if control else None
        found.append(Loop(a, i, ops, _kinds(straight), _sequence(straight), stalls))
    # the innermost: those around no other such loop (outer loops repeat their inner ones' mix)
    inner = [x for x in found if not any(y is not x and x.start <= y.start and y.end <= x.end for y in found)]
    return sorted(inner, key=lambda loop: (loop.size, loop.start))


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_of_cubin(path: Path) -> str:
    """nvdisasm's listing of a cubin."""
    done = subprocess.run([_tool("nvdisasm"), "-c", "-hex", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvdisasm could not read {path}: {done.stderr.strip()[-300:]}")
    return done.stdout


def port_sass(mask_name: str = "causal", loop: str = "persistent", settings: dict | None = None,
              head_dim: int = 128) -> str:
    """The SASS of the port's Hopper forward for `mask_name` (a library mask, built at 1,024 tokens,
    bf16, B 2, 4 query / 2 kv heads), compiled for sm_90a without a GPU, with HOPPER_LOOP = `loop`
    and the file's other Hopper settings as `settings` gives them (e.g. {"HOPPER_LANE_SUMS": 0})."""
    import os

    from triton.runtime import driver

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import run_hopper_compile
    from workbench import make, port

    interpret = os.environ.pop("TRITON_INTERPRET", None)  # (the real compiler; put back after)
    # (the stand-in driver for the compile, the caller's put back after: Triton makes no default
    # driver on a machine without a GPU, so reset_active would fail there)
    previous = getattr(driver, "_active", None)
    driver.set_active(run_hopper_compile._Target())
    try:
        folder = Path(tempfile.mkdtemp(prefix="sass_loops_"))
        module = port.load(port.build(make(mask_name), 1024, 1024, heads=4, batch=2, out_dir=folder / "m"))
        if module.HOPPER_MODS is not None:
            raise ValueError(f"{mask_name!r} has no Gluon copy of its mods: {module.HOPPER_MODS}")
        q, k, v, tables = run_hopper_compile.stand_in(module, D=head_dim)
        module.HOPPER_LOOP = loop
        for name, value in (settings or {}).items():
            if not hasattr(module, name):
                raise ValueError(f"the port's file has no setting {name}: give one of its HOPPER_ names")
            setattr(module, name, value)
        grid, args, options, *_ = module._hopper_launch(q, k, v, head_dim ** -0.5, True, tables)
        kernel = module._hopper_kernel().warmup(*args, grid=grid, **options)
    finally:
        driver.set_active(previous)
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    return run_hopper_compile.sass_of(kernel, words=True)


def _setting(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not name.startswith("HOPPER_") or not value.strip().lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=INTEGER with a HOPPER_ name (e.g. HOPPER_LANE_SUMS=0)")
    return name, int(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--port", nargs="?", const="causal", metavar="MASK",
                        help="compile the port's Hopper forward for this library mask (default causal)")
    source.add_argument("--cubin", type=Path, help="a cubin compiled elsewhere")
    p.add_argument("--loop", default="persistent", help="--port: HOPPER_LOOP (default persistent)")
    p.add_argument("--set", type=_setting, nargs="*", default=[], metavar="HOPPER_NAME=VALUE",
                   help="--port: the file's Hopper settings, e.g. HOPPER_LANE_SUMS=0 HOPPER_NAMED=3")
    p.add_argument("--order", type=int, metavar="LINE", help="the straight path, as a sequence, of the loop the "
                   "table lists as starting at LINE")
    args = p.parse_args(argv)
    if args.cubin is not None and not args.cubin.is_file():
        p.error(f"--cubin {args.cubin}: no such file")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from workbench import WorkbenchError

    try:
        sass = sass_of_cubin(args.cubin) if args.cubin else port_sass(args.port, args.loop, dict(args.set))
    except (WorkbenchError, ValueError, RuntimeError) as exc:  # (no such mask or setting; not a cubin)
        p.error(str(exc))
    found = loops(sass)
    if not found:
        print("no loop that issues warpgroup MMAs (HGMMA) in this kernel")
        return 1
    print("| lines | instructions | straight path | its stall cycles | after the last EX2 (FMUL) | "
          + " | ".join(KINDS) + " |")
    print("|---" * (5 + len(KINDS)) + "|")
    for loop in found:
        print(f"| {loop.start}-{loop.end} | {loop.size} | {loop.path_size} | "
              f"{'-' if loop.stalls is None else loop.stalls} | {loop.tail[0]} ({loop.tail[1]}) | "
              + " | ".join(str(loop.path[k]) for k in KINDS) + " |")
    if args.order is not None:
        chosen = [loop for loop in found if loop.start == args.order]
        if not chosen:
            p.error(f"--order {args.order}: no loop of the table starts at that line: give one of "
                    f"{', '.join(str(loop.start) for loop in found)}")
        print(f"\nthe straight path of lines {chosen[0].start}-{chosen[0].end}:")
        for name, count in chosen[0].order:
            print(f"{count:4d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
