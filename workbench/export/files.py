"""The spec on disk: `PortingSpec` in memory (the JSON document and the arrays it references by
{"$tensor": name}), `write_spec` (NAME-DIGEST.spec.json + .golden.safetensors, validated against
spec.schema.json) and `load_spec`, which reads them back with JSON and safetensors only (no
pickle, no code runs) and checks every reference, shape and golden digest."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from workbench import port
from workbench.define import WorkbenchError, cdiv, output_folder

__all__ = ["PortingSpec", "summarize", "SPEC_VERSION", "TARGETS", "write_spec", "load_spec", "validate_doc", "check_shapes",
           "check_golden", "tensor_digest", "spec_stem", "doc_file"]


SPEC_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).with_name("spec.schema.json")
TARGETS = ("flash_attn", "vllm_triton", "magi", "flashmask", "row_intervals", "block_sparse", "triton",
           "triton_attention", "flash_attn_cute")
INLINE_LIMIT = 4096  # integer arrays longer than this go to the safetensors file


@dataclass
class PortingSpec:
    """A spec in memory: the JSON document and the arrays it references by {"$tensor": name}."""

    doc: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    port: Any = None  # port.PortSource: the generated attention file, written next to the spec
    fa4: Any = None  # fa4.Fa4Source: the generated FlashAttention-4 file, written next to the spec

    @property
    def name(self) -> str:
        return self.doc["name"]

    @property
    def supported(self) -> list[str]:
        return list(self.doc["backends"])

    @property
    def unsupported(self) -> dict[str, str]:
        return dict(self.doc["unsupported"])

    def source(self, target: str = "triton") -> str:
        """The generated source a section carries (the Triton mods; the port's file), as text."""
        if target == "triton_attention" and self.port is not None:
            return self.port.source
        if target == "flash_attn_cute" and self.fa4 is not None:
            return self.fa4.source
        section = self.doc["backends"].get(target)
        if not isinstance(section, dict) or "source" not in section:
            raise WorkbenchError(f"the spec has no {target} source",
                                 f"sections with source: {', '.join(k for k, v in self.doc['backends'].items() if isinstance(v, dict) and 'source' in v) or 'none'}")
        return section["source"]

    def backends_frame(self) -> pd.DataFrame:
        """One row per backend: exact or not, the arguments of an exact one (its spec section as
        compact JSON, long lists as their first entries and a count, source as its line count;
        arrays appear as {"$tensor": name} references) and, if not, the reason."""
        rows = [dict(backend=t, exact=t in self.doc["backends"],
                     arguments=_compact(self.doc["backends"][t]) if t in self.doc["backends"] else "",
                     reason=self.doc["unsupported"].get(t, "")) for t in TARGETS]
        return pd.DataFrame(rows).set_index("backend")

    def backends_view(self):
        """`backends_frame` for a notebook: every argument and reason in full, wrapped (a bare
        DataFrame cuts cells at 50 characters)."""
        return (self.backends_frame().style
                .set_properties(**{"white-space": "pre-wrap", "text-align": "left", "font-size": "12px"})
                .set_properties(subset=["arguments"], **{"font-family": "monospace", "max-width": "640px"})
                .set_table_styles([{"selector": "th", "props": [("text-align", "left")]}]))


ARGUMENTS_SHOWN = 4000  # characters of a section shown in a table; the spec file has all of it


LIST_SHOWN = 4  # entries of a long list shown in a summary (the spec file has all of them)


def summarize(value):
    """A section as a person reads it in a table: long lists as their first entries and a count,
    source text as its line count (`PortingSpec.source` shows it as code)."""
    if isinstance(value, dict):
        return {k: summarize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > 2 * LIST_SHOWN:
            return [summarize(v) for v in value[:LIST_SHOWN]] + [f"... {len(value):,} entries in all"]
        return [summarize(v) for v in value]
    if isinstance(value, str) and value.count("\n") > 2:
        return f"<{value.count(chr(10)) + 1} lines of source: spec.source(...)>"
    return value


def _compact(section) -> str:
    text = json.dumps(summarize(section), separators=(", ", ": "))
    if len(text) <= ARGUMENTS_SHOWN:
        return text
    return text[:ARGUMENTS_SHOWN] + f" ... ({len(text):,} characters; all of it in the spec file)"


def tensor_digest(array: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes: a golden file edited after export (zeroed,
    NaN-filled, swapped) no longer matches the digest its spec recorded."""
    import hashlib

    h = hashlib.sha256(f"{array.dtype.str}{list(array.shape)}".encode())
    h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- files

def spec_stem(doc: dict, tensors: dict | None = None) -> str:
    """NAME-DIGEST: the mask's name and 8 hex digits of everything that makes two masks differ --
    parameters, shape, the mods' source, every exact form and the bytes of every table the spec
    carries (golden vectors, timings and the file's own bookkeeping excluded) -- so one export never
    replaces another's file (two span masks of one name with other spans, say)."""
    import hashlib

    kept = {k: v for k, v in doc.items() if k not in ("golden", "cost", "tensor_file", "tensors")}
    digest = hashlib.sha256(json.dumps(_json_ready(kept), sort_keys=True, default=str).encode())
    for name in sorted(tensors or {}):
        if not name.startswith("golden."):
            array = np.ascontiguousarray(tensors[name])
            digest.update(f"{name}{array.dtype.str}{list(array.shape)}".encode())
            digest.update(array.tobytes())
    return f"{_safe_name(doc['name'])}-{digest.hexdigest()[:8]}"


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in name)


def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate_doc(doc: dict, where: str = "spec") -> None:
    try:
        import jsonschema
    except ImportError as exc:  # a declared dependency; an environment assembled by hand can lack it
        raise WorkbenchError("checking a porting spec against its schema needs the `jsonschema` package, which is "
                             "not installed", "install it (`pip install jsonschema`, or `make test` / "
                             "`pip install -e .` which pull it in)") from exc

    try:
        jsonschema.validate(doc, _schema())
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise WorkbenchError(f"{where} fails the porting-spec schema at `{path}`: {exc.message[:300]}",
                             "fix that field, or export the spec again with `python -m workbench export`") from exc


def write_spec(spec: PortingSpec, out_dir: str | Path) -> tuple[Path, Path]:
    from safetensors.numpy import save_file

    out = output_folder(out_dir, spec.name)
    base = spec_stem(spec.doc, spec.tensors)
    doc = dict(spec.doc)
    doc["tensor_file"] = f"{base}.golden.safetensors"
    doc["tensors"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(spec.tensors.items())}
    doc = _json_ready(doc)
    validate_doc(doc)
    json_path, st_path = out / f"{base}.spec.json", out / f"{base}.golden.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in spec.tensors.items()}, str(st_path),
              metadata={"spec": json_path.name, "spec_version": SPEC_VERSION})
    json_path.write_text(json.dumps(doc, indent=1))
    if spec.port is not None:

        port.write(spec.port, out)
    if spec.fa4 is not None:
        from workbench import fa4

        fa4.write(spec.fa4, out)
    return json_path, st_path


def _json_ready(value):
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _resolve(value, tensors: dict, field_path: str = ""):
    """Replace {"$tensor": name} by the array (numpy) everywhere inside `value`."""
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            name = value["$tensor"]
            if name not in tensors:
                raise WorkbenchError(f"field `{field_path}` references tensor {name!r}, which is not in the tensor file",
                                     "export the spec again so the JSON and the safetensors file match")
            return tensors[name]
        return {k: _resolve(v, tensors, f"{field_path}/{k}" if field_path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors, f"{field_path}/{i}") for i, v in enumerate(value)]
    return value


def load_spec(path: str | Path, golden: bool = True) -> PortingSpec:
    """Read NAME.spec.json and its safetensors file: JSON and safetensors only (no pickle, no
    code runs). Validates the schema, every tensor reference and every array shape; with `golden`
    also the golden vectors' digests (what `diff`, which never reads them, skips)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if path.is_dir():
        raise WorkbenchError(f"{path} is a directory, not a spec file", "pass the NAME.spec.json that `export` wrote")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise WorkbenchError(f"no spec file at {path}", "pass the NAME.spec.json that `export` wrote") from exc
    except UnicodeDecodeError as exc:
        raise WorkbenchError(f"{path.name} is not UTF-8 text, so it is not a spec (nothing in it was run)",
                             "pass the NAME.spec.json that `export` wrote") from exc
    except json.JSONDecodeError as exc:
        raise WorkbenchError(f"{path.name} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                             "export the spec again, or repair the JSON") from exc
    except RecursionError as exc:
        raise WorkbenchError(f"{path.name} is nested too deeply to be a spec", "pass the NAME.spec.json that `export` "
                             "wrote") from exc
    except OSError as exc:
        raise WorkbenchError(f"cannot read {path}: {exc.strerror or exc}", "pass a readable spec file") from exc
    if not isinstance(doc, dict):
        raise WorkbenchError(f"{path.name} holds a JSON {type(doc).__name__}, not a spec object (it fails the "
                             "porting-spec schema)", "pass the NAME.spec.json that `export` wrote")
    try:
        validate_doc(doc, path.name)
    except RecursionError as exc:
        raise WorkbenchError(f"{path.name} is nested too deeply to be a spec", "pass the NAME.spec.json that `export` "
                             "wrote") from exc
    st_path = path.with_name(doc["tensor_file"])
    try:
        tensors = load_file(str(st_path))
    except FileNotFoundError as exc:
        raise WorkbenchError(f"the tensor file {st_path.name} named by `tensor_file` is missing",
                             "keep NAME.spec.json and NAME.golden.safetensors together") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise WorkbenchError(f"{st_path.name} is not a readable safetensors file ({exc})",
                             "export the spec again") from exc
    spec = PortingSpec(doc, tensors)
    check_shapes(spec, golden)
    return spec


def _expect(cond: bool, field_path: str, what: str):
    if not cond:
        raise WorkbenchError(f"field `{field_path}` has the wrong shape: {what}",
                             "export the spec again so every array matches the spec's shape")


def _sections(section, path):
    if isinstance(section, dict) and "by_batch" in section:
        for b, s in enumerate(section["by_batch"]):
            yield from _sections(s, f"{path}/by_batch/{b}")
    elif isinstance(section, dict) and "by_head" in section:
        for h, s in enumerate(section["by_head"]):
            yield from _sections(s, f"{path}/by_head/{h}")
    else:
        yield section, path


def check_shapes(spec: PortingSpec, golden: bool = True) -> None:
    doc, tensors = spec.doc, spec.tensors
    q_len, kv_len = doc["shape"]["q_len"], doc["shape"]["kv_len"]
    _resolve(doc, tensors)  # every reference exists
    for name, meta in doc.get("tensors", {}).items():
        _expect(name in tensors and list(tensors[name].shape) == meta["shape"], f"tensors/{name}",
                f"index says {meta['shape']}, file has {list(tensors[name].shape) if name in tensors else 'nothing'}")
    backends = doc["backends"]
    for target, section in backends.items():
        for s, p in _sections(section, f"backends/{target}"):
            s = _resolve(s, tensors, p)
            if target == "row_intervals":
                rows = np.asarray(s["rows"]) if not isinstance(s["rows"], np.ndarray) else s["rows"]
                _expect(len(rows) == q_len, f"{p}/rows", f"{len(rows)} rows for q_len {q_len}")
            elif target == "flashmask":
                arr = np.asarray(s["startend_row_indices"])
                _expect(arr.ndim == 2 and arr.shape[0] == kv_len and arr.shape[1] in (1, 2, 4),
                        f"{p}/startend_row_indices", f"{list(arr.shape)}, want [kv_len={kv_len}, 1|2|4]")
            elif target == "block_sparse":
                rows = cdiv(q_len, s["R"])
                _expect(len(s["indptr"]) == rows + 1, f"{p}/indptr", f"{len(s['indptr'])} entries, want {rows + 1}")
                _expect(len(s["indices"]) == len(s["partial"]) == int(s["indptr"][-1]), f"{p}/indices",
                        "indices/partial lengths differ from indptr[-1]")
            elif target == "magi":
                _expect(len(s["q_ranges"]) == len(s["k_ranges"]) == len(s["attn_type_map"]), f"{p}/q_ranges",
                        "q_ranges, k_ranges and attn_type_map differ in length")
    g = doc.get("golden")
    if g:
        want = {"q": [q_len], "out": [q_len], "lse": [q_len], "k": [kv_len], "v": [kv_len]}
        for key, (length,) in want.items():
            declared = g["shapes"].get(key, [])
            _expect(len(declared) >= 3 and declared[2] == length, f"golden/shapes/{key}",
                    f"{key} has length {declared[2] if len(declared) >= 3 else '?'}, but shape says "
                    f"{'q_len' if key in ('q', 'out', 'lse') else 'kv_len'} = {length}")
        for n in range(g["vectors"]):
            for key in golden_keys(g):
                name = f"golden.{n}.{key}"
                _expect(key in g["shapes"], f"golden/shapes/{key}", f"no shape for {key}")
                _expect(name in tensors and list(tensors[name].shape) == g["shapes"][key], f"golden/shapes/{key}",
                        f"{name} is {list(tensors[name].shape) if name in tensors else 'missing'}, want {g['shapes'][key]}")
        if golden:
            check_golden(spec)


def check_golden(spec: PortingSpec) -> None:
    """Golden vectors are trusted only when they match the digests the spec recorded at export
    and hold no NaN (a NaN golden would let any port pass)."""
    g, tensors = spec.doc["golden"], spec.tensors
    digests = g.get("sha256")
    if not isinstance(digests, dict) or not digests:
        raise WorkbenchError("the spec's golden vectors carry no sha256 digests, so edits to them cannot be detected",
                             "export the spec again with this version (`python -m workbench export`)")
    for n in range(g["vectors"]):
        for key in golden_keys(g):
            name = f"golden.{n}.{key}"
            want = digests.get(name)
            if want is None or tensor_digest(tensors[name]) != want:
                raise WorkbenchError(f"golden tensor {name} in {doc_file(spec)} does not match the digest recorded at "
                                     "export: the file was modified after it was written",
                                     "export the spec again; never edit golden vectors by hand")
            if np.isnan(tensors[name]).any():
                raise WorkbenchError(f"golden tensor {name} holds NaN; NaN goldens would let any port pass",
                                     "export the spec again from a mask whose reference is finite")


def golden_keys(golden: dict) -> tuple:
    """The tensors of each golden vector: q, k, v, out, lse, and the gradients where the spec has
    them (`golden.gradients`: grad_out, dq, dk, dv)."""
    extra = golden.get("gradients") or []
    return ("q", "k", "v", "out", "lse", *[k for k in extra if isinstance(k, str)])


def doc_file(spec: PortingSpec) -> str:
    return spec.doc.get("tensor_file", "the tensor file")
