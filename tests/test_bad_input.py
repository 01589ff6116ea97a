"""Bad and tricky input, by entry point: every bad input exits non-zero with an error that names
the cause and the fix (no traceback, no hang, no silent default), and tricky-but-valid input
works. The CLI runs in-process (`workbench.cli.main`), as `python -m workbench` would."""

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli
from workbench import Mask, make
from workbench.define import WorkbenchError, parse_params

HERE = Path(__file__).resolve().parent / "bad_inputs"
MODS = HERE / "mods.py"
IMPLS = HERE / "impls.py"


cli = run_cli


def bad(capsys, *argv, match, rc=2):
    code, out, err = cli(capsys, *argv)
    assert code == rc, (code, out[-2000:], err[-2000:])
    text = out + err
    assert "Traceback" not in text, text[-3000:]
    assert match.lower() in text.lower(), text[-3000:]
    return text


def target(name):
    return f"{MODS}:{name}"


# ---------------------------------------------------------------- sizes and flags (never a silent default)

SIZE_CASES = [
    ("verify", "causal", "--q-len", "0"),
    ("verify", "causal", "--q-len", "-5"),
    ("verify", "causal", "--q-len", "64", "--kv-len", "0"),
    ("verify", "causal", "--q-len", "64", "--heads", "0"),
    ("verify", "causal", "--q-len", "64", "--batch", "0"),
    ("verify", "causal", "--q-len", "64", "--kv-heads", "0"),
    ("verify", "causal", "--q-len", "64", "--head-dim", "0"),
    ("blocks", "causal", "--q-len", "0"),
    ("blocks", "causal", "--q-len", "64", "--kv-len", "-1"),
    ("blocks", "causal", "--q-len", "64", "--block-size", "0"),
    ("blocks", "causal", "--q-len", "64", "--block-size", "-128"),
    ("report", "causal", "--q-len", "0"),
    ("report", "causal", "--heads", "0"),
    ("export", "causal", "--q-len", "0", "-o", "unused"),
    ("export", "causal", "--q-len", "64", "--batch", "0", "-o", "unused"),
    ("port", "causal", "--q-len", "0", "-o", "unused"),
    ("port", "causal", "--q-len", "64", "--head-dim", "-3", "-o", "unused"),
]


@pytest.mark.parametrize("argv", SIZE_CASES, ids=lambda a: " ".join(a))
def test_zero_or_negative_sizes_are_errors_not_defaults(capsys, argv):
    bad(capsys, *argv, match="positive integer")


@pytest.mark.parametrize("argv,match", [
    (("verify", "causal", "--q-len", "abc"), "invalid"),
    (("blocks", "causal", "--q-len", "64", "--block-size", "1", "2", "3"), "one or two numbers"),
    (("verify", "causal", "--q-len", "64", "--dtype", "nosuch"), "unknown dtype 'nosuch'"),
    (("verify", "causal", "--q-len", "64", "--dtype", "tf32", "--device", "cpu"), "tf32 exists only on CUDA"),
    (("verify", "causal", "--q-len", "64", "--device", "foo"), "unknown device 'foo'"),
    (("verify", "causal", "--q-len", "64", "--device", "cuda"), "no GPU"),
    (("blocks", "causal", "--q-len", "64", "--device", "cuda:7"), "no GPU"),
    (("verify", "causal", "--q-len", "64", "--device", "cpu", "--backward"), "no backward on the CPU"),
    (("verify", "causal", "--q-len", "64", "--heads", "3", "--kv-heads", "2"), "not a multiple"),
    (("verify", "per_head_window", "--q-len", "64", "--heads", "9", "--device", "cpu"), "defined for 8 heads"),
    (("verify", "causal", "--q-len", "64", "--score", "causal"), "has no score_mod"),
    (("verify", "causal", "--q-len", "64", "--score", "nosuch"), "no library mask named 'nosuch'"),
    (("verify", "causal", "--q-len", "64", "--score-param", "cap=3"), "--score-param needs --score"),
    (("blocks", "causal", "--q-len", "64", "--engine", "triton", "--device", "cpu"), "runs on CUDA"),
    (("export", "causal", "--q-len", "20000", "-o", "unused"), "would list"),
    (("report", "--param", "window=3"), "--param needs a TARGET"),
    (("verify", "causal", "--q-len", "64", "--backend", "nosuch"), "invalid choice"),
    (("verify", "causal", "--q-len", "64", "--backend", "port-paged", "--backward", "--device", "cpu"),
     "it has no backward"),
    (("port", "causal", "--q-len", "64", "--device", "foo", "-o", "unused"), "unknown device 'foo'"),
    (("port", "causal", "--q-len", "64", "--dtype", "nosuch", "--device", "cpu", "-o", "unused"), "unknown dtype"),
    (("port", "per_head_window", "--q-len", "64", "--heads", "9", "--device", "cpu", "-o", "unused"),
     "defined for 8 heads"),
], ids=lambda a: " ".join(a) if isinstance(a, tuple) else "")
def test_bad_flags(capsys, argv, match):
    bad(capsys, *argv, match=match)


# ---------------------------------------------------------------- targets and parameters

@pytest.mark.parametrize("argv,match", [
    (("verify", "nosuchmask", "--q-len", "64"), "no library mask named 'nosuchmask'"),
    (("verify", "/no/such/file.py:f", "--q-len", "64"), "does not exist"),
    (("verify", f"{MODS}:missing", "--q-len", "64"), "has no function 'missing'"),
    (("verify", f"{HERE / 'syntax_error.py'}:broken", "--q-len", "64"), "importing"),
    (("verify", f"{HERE / 'exits_on_import.py'}:f", "--q-len", "64"), "sys.exit"),
    (("verify", target("exiting_factory"), "--q-len", "64"), "sys.exit"),
    (("verify", target("raising_factory"), "--q-len", "64"), "width must be even"),
    (("verify", target("int_factory"), "--q-len", "64"), "factory returned int"),
    (("verify", target("fine_factory"), "--q-len", "64", "--param", "width=[1,2"), "not valid JSON"),
    (("verify", target("fine_factory"), "--q-len", "64", "--param", "noequals"), "not key=value"),
    (("verify", target("fine_factory"), "--q-len", "64", "--param", "=5"), "not key=value"),
    (("verify", target("fine_factory"), "--q-len", "64", "--param", "height=5"), "unknown parameter 'height'"),
    (("verify", target("bare_causal"), "--q-len", "64", "--param", "width=5"), "takes no parameters"),
    (("verify", target("fine_factory"), "--q-len", "64", "--param", "width=plain"), "takes int"),
    (("verify", target("needs_args"), "--q-len", "64"), "needs values for width"),
    (("verify", "nosuchpkg.mod:f", "--q-len", "64"), "cannot import module 'nosuchpkg.mod'"),
    (("verify", "masks.causal:nosuch", "--q-len", "64"), "has no function 'nosuch'"),
], ids=lambda a: " ".join(a[:2]) if isinstance(a, tuple) else "")
def test_bad_targets(capsys, argv, match):
    bad(capsys, *argv, match=match)


@pytest.mark.parametrize("mod,match", [
    ("python_if", "Python `if`"),
    ("item_call", ".item()"),
    ("int_result", "bool"),
    ("wrong_shape", "one value per"),
    ("short_table", "'table10' (10 entries)"),
    ("numpy_table", "numpy array 'array'"),
    ("random_mask", "random numbers"),
    ("changing_global", "different values"),
    ("five_arg_mask", "5 arguments starting with 'b'"),
    ("three_arg_mask", "takes 3 positional arguments"),
])
@pytest.mark.parametrize("command", ["verify", "blocks", "export", "port"])
def test_broken_mods_are_named_on_every_command(capsys, tmp_path, mod, match, command):
    extra = ["-o", tmp_path] if command in ("export", "port") else []
    bad(capsys, command, target(mod), "--q-len", "64", "--device", "cpu", *extra, match=match)


@pytest.mark.parametrize("argv,match", [
    (("verify", target("bool_score"), "--q-len", "64"), "float score"),
    (("blocks", target("per_head"), "--q-len", "64"), "reads `h`"),
    (("export", target("per_sample"), "--q-len", "64", "-o", "unused"), "reads `b`"),
    (("verify", target("meta_table"), "--q-len", "64", "--device", "cpu"), "'table' on meta"),
    (("verify", target("short_table"), "--q-len", "200", "--device", "cpu", "--eager"), "too short"),
], ids=lambda a: " ".join(a[:2]) if isinstance(a, tuple) else "")
def test_bad_mods_in_context(capsys, argv, match):
    bad(capsys, *argv, match=match)


@pytest.mark.parametrize("argv", [
    ("verify", target("star_args"), "--q-len", "64", "--eager", "--dtype", "float32"),
    ("verify", target("bare_causal"), "--q-len", "33", "--kv-len", "70", "--eager", "--dtype", "float32"),
    ("blocks", target("per_head"), "--q-len", "50", "--heads", "4"),
    ("blocks", "masks.causal:causal", "--q-len", "100"),
    ("blocks", f"{HERE / 'pkg' / 'sub' / 'masks_in_package.py'}:package_band", "--q-len", "64"),
    ("blocks", target("windows_factory"), "--q-len", "64", "--param", "left=[1,2,3]"),
    ("blocks", target("named_factory"), "--q-len", "64", "--param", "kind=plain"),
    ("verify", "causal", "--q-len", "1", "--kv-len", "1", "--eager", "--dtype", "float32"),
    ("verify", "sliding_window", "--q-len", "37", "--kv-len", "301", "--block-size", "16", "--eager",
     "--dtype", "float32"),
], ids=lambda a: " ".join(a[:2]))
def test_tricky_but_valid_input_works(capsys, argv):
    code, out, err = cli(capsys, *argv)
    assert code == 0, out[-2000:] + err[-2000:]


def test_fine_factory_takes_a_plain_string_parameter_as_a_string():
    assert parse_params(["name=abc", "spans=[[0,9]]", "n=3"]) == {"name": "abc", "spans": [[0, 9]], "n": 3}
    with pytest.raises(WorkbenchError, match=r"not valid JSON.*Fix"):
        parse_params(["spans=[[0,9]"])


# ---------------------------------------------------------------- specs, conformance, diff

@pytest.fixture(scope="module")
def causal_spec(tmp_path_factory):
    from workbench.export import build_spec, write_spec

    folder = tmp_path_factory.mktemp("spec")
    spec = build_spec(make("causal"), 48, 48, head_dim=16, seed=0, generalize=False)
    json_path, st_path = write_spec(spec, folder)
    return json_path, st_path


def copy_spec(causal_spec, tmp_path, edit_doc=None, edit_tensors=None):
    from safetensors.numpy import load_file, save_file

    json_path, st_path = causal_spec
    doc = json.loads(json_path.read_text())
    tensors = load_file(str(st_path))
    if edit_doc:
        edit_doc(doc)
    if edit_tensors:
        edit_tensors(tensors)
    (tmp_path / json_path.name).write_text(json.dumps(doc))
    save_file(tensors, str(tmp_path / st_path.name))
    return tmp_path / json_path.name


def test_good_impl_passes_and_same_spec_diffs_same(capsys, causal_spec):
    json_path, _ = causal_spec
    code, out, _ = cli(capsys, "conformance", json_path, "--impl", f"{IMPLS}:reference_causal")
    assert code == 0 and "PASS" in out
    code, out, _ = cli(capsys, "diff", json_path, json_path)
    assert code == 0 and "SAME" in out


@pytest.mark.parametrize("impl,match", [
    ("zeros", "elements outside"),
    ("raises", "kernel launch failed"),
    ("wrong_shape", "want a tensor of shape"),
    ("returns_none", "NoneType"),
    ("returns_nan", "NaN"),
    ("returns_meta", "meta"),
    ("exits", "sys.exit"),
])
def test_bad_impls_fail_with_the_reason(capsys, causal_spec, impl, match):
    json_path, _ = causal_spec
    bad(capsys, "conformance", json_path, "--impl", f"{IMPLS}:{impl}", match=match, rc=1)


def test_an_impl_that_never_returns_times_out(capsys, causal_spec):
    json_path, _ = causal_spec
    text = bad(capsys, "conformance", json_path, "--impl", f"{IMPLS}:hangs", "--timeout", "1", match="did not return",
               rc=1)
    assert "--timeout" in text


@pytest.mark.parametrize("argv_tail,match", [
    (("--impl", f"{IMPLS}:nosuch"), "has no function 'nosuch'"),
    (("--impl", f"{HERE / 'exits_on_import.py'}:f"), "sys.exit"),
    (("--impl", f"{IMPLS}:zeros", "--dtype", "nosuch"), "unknown dtype"),
    (("--impl", f"{IMPLS}:zeros", "--timeout", "0"), "positive"),
], ids=lambda a: a[-1] if isinstance(a, tuple) else "")
def test_bad_conformance_flags(capsys, causal_spec, argv_tail, match):
    bad(capsys, "conformance", causal_spec[0], *argv_tail, match=match)


def _null_golden(doc):
    doc["golden"] = None


def _short_golden(doc):
    doc["shape"]["q_len"] = 40


def _no_row_intervals(doc):
    del doc["backends"]["row_intervals"]


def _zero_out(tensors):
    tensors["golden.0.out"] = np.zeros_like(tensors["golden.0.out"])


def _nan_out(tensors):
    tensors["golden.1.out"] = np.full_like(tensors["golden.1.out"], np.nan)


def _swap_vectors(tensors):
    tensors["golden.0.out"], tensors["golden.1.out"] = tensors["golden.1.out"], tensors["golden.0.out"]


@pytest.mark.parametrize("edit_doc,edit_tensors,match", [
    (_null_golden, None, "no golden vectors"),
    (_short_golden, None, "q_len"),
    (None, _zero_out, "digest"),
    (None, _nan_out, "digest"),
    (None, _swap_vectors, "digest"),
])
def test_edited_specs_are_refused_by_conformance(capsys, causal_spec, tmp_path, edit_doc, edit_tensors, match):
    path = copy_spec(causal_spec, tmp_path, edit_doc, edit_tensors)
    bad(capsys, "conformance", path, "--impl", f"{IMPLS}:zeros", match=match)


def test_diff_without_row_intervals_reads_another_exact_section(capsys, causal_spec, tmp_path):
    path = copy_spec(causal_spec, tmp_path, _no_row_intervals)
    code, out, err = cli(capsys, "diff", path, causal_spec[0])
    assert code == 0 and "SAME" in out, out + err


def test_diff_of_huge_declared_lengths_does_not_allocate(capsys, causal_spec, tmp_path):
    import time

    def huge(doc):
        doc["shape"]["kv_len"] = 2 ** 40

    path = copy_spec(causal_spec, tmp_path, huge)
    start = time.perf_counter()
    bad(capsys, "diff", path, causal_spec[0], match="kv_len")
    assert time.perf_counter() - start < 10


def test_diff_of_different_lengths_explains(capsys, tmp_path, causal_spec):
    from workbench.export import build_spec, write_spec

    other, _ = write_spec(build_spec(make("causal"), 64, 64, golden=False, generalize=False), tmp_path)
    text = bad(capsys, "diff", causal_spec[0], other, match="lengths differ", rc=1)
    import re

    assert "-1" not in re.sub(r"\S+\.spec\.json", "", text)  # (file names carry hex digests)


@pytest.mark.parametrize("content,match", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "nested"),
    (b"{}", "schema"),
    (b'{"spec_version": "1.0"}', "schema"),
])
@pytest.mark.parametrize("command", ["conformance", "diff"])
def test_broken_spec_files(capsys, tmp_path, causal_spec, content, match, command):
    path = tmp_path / "broken.spec.json"
    path.write_bytes(content)
    tail = ("--impl", f"{IMPLS}:zeros") if command == "conformance" else (causal_spec[0],)
    bad(capsys, command, path, *tail, match=match)


@pytest.mark.parametrize("command", ["conformance", "diff"])
def test_a_directory_or_missing_file_as_spec(capsys, tmp_path, causal_spec, command):
    tail = ("--impl", f"{IMPLS}:zeros") if command == "conformance" else (causal_spec[0],)
    bad(capsys, command, tmp_path, *tail, match="is a directory")
    bad(capsys, command, tmp_path / "none.spec.json", *tail, match="no spec file")


def test_missing_or_garbage_tensor_file(capsys, causal_spec, tmp_path):
    path = copy_spec(causal_spec, tmp_path)
    st = path.with_name(json.loads(path.read_text())["tensor_file"])
    st.write_bytes(b"not safetensors")
    bad(capsys, "conformance", path, "--impl", f"{IMPLS}:zeros", match="not a readable safetensors")
    st.unlink()
    bad(capsys, "conformance", path, "--impl", f"{IMPLS}:zeros", match="is missing")


def test_a_pickle_spec_is_never_unpickled(capsys, tmp_path):
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "evil.spec.json"
    path.write_bytes(pickle.dumps(Payload()))
    bad(capsys, "diff", path, path, match="spec")
    assert not marker.exists()


def test_unwritable_output_folders(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad(capsys, "export", "causal", "--q-len", "32", "-o", blocker / "sub", match="cannot write")
    bad(capsys, "blocks", "causal", "--q-len", "32", "-o", blocker / "sub", match="cannot write")
    bad(capsys, "report", "causal", "--q-len", "32", "-o", blocker / "sub", match="cannot write")


# ---------------------------------------------------------------- report: a stuck or exiting mask

def test_report_times_out_a_stuck_factory_and_writes_the_rest(capsys, tmp_path):
    code, out, err = cli(capsys, "report", target("stuck_factory"), "--q-len", "64", "-o", tmp_path,
                         "--timeout", "2")
    assert code == 1 and "timed out after 2" in err, out + err
    assert (tmp_path / "report.html").exists() and "stuck_factory" in (tmp_path / "report.html").read_text()


def test_report_of_a_factory_that_exits_writes_the_report(capsys, tmp_path):
    code, out, err = cli(capsys, "report", target("exiting_factory"), "--q-len", "64", "-o", tmp_path)
    assert code == 1 and "sys.exit" in err
    assert (tmp_path / "report.html").exists()


# ---------------------------------------------------------------- Python API

def _api_cases():
    from workbench.blocks import scan_blocks
    from workbench.export import build_spec
    from workbench.run import Shape, make_inputs
    from workbench.verify import verify

    def branchy(b, h, q_idx, kv_idx):
        return q_idx >= 0 if q_idx >= kv_idx else q_idx < 0

    return [
        ("Shape(q_len=0)", lambda: Shape(q_len=0), "positive integer"),
        ("Shape(head_dim=-1)", lambda: Shape(head_dim=-1), "positive integer"),
        ("make_inputs bad device", lambda: make_inputs(Shape(), device="foo"), "unknown device"),
        ("verify bad dtype", lambda: verify(make("causal"), Shape(q_len=16), dtype="nosuch"), "unknown dtype"),
        ("verify python if", lambda: verify(Mask("branchy", mask_mod=branchy), Shape(q_len=16), dtype="float32", backend="eager"), "Python `if`"),
        ("scan_blocks zero", lambda: scan_blocks(make("causal"), 0, 5), "positive integer"),
        ("scan_blocks float length", lambda: scan_blocks(make("causal"), 1.5, 5), "positive integer"),
        ("build_spec zero", lambda: build_spec(make("causal"), 0), "positive integer"),
        ("Mask not callable", lambda: Mask("x", mask_mod=3), "not a function"),
        ("make unknown", lambda: make("nosuch"), "no library mask"),
    ]


@pytest.mark.parametrize("name,call,match", _api_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_python_api_errors(name, call, match):
    with pytest.raises(WorkbenchError, match=match) as info:
        call()
    assert "Fix:" in str(info.value)


def test_conformance_api_with_a_callable_returning_a_list(causal_spec):
    from workbench.export import conformance

    report = conformance(causal_spec[0], lambda q, k, v, spec: [1, 2])
    assert not report.passed and "list" in report.rows[0]["message"]


def test_inputs_are_random_never_zeros():
    from workbench.run import Shape, make_inputs

    inputs = make_inputs(Shape(q_len=8, head_dim=8), "float32")
    assert all(float(t.abs().sum()) > 0 and math.isfinite(float(t.sum())) for t in (inputs.q, inputs.k, inputs.v))


def test_spec_validation_without_jsonschema_names_the_package(monkeypatch):
    # an environment assembled by hand (a GPU box with a carried site folder) can lack a declared dependency
    import sys

    from workbench.export.files import validate_doc

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` now raises ImportError
    with pytest.raises(WorkbenchError, match=r"needs the `jsonschema` package.*Fix: install it"):
        validate_doc({"name": "x"})
