"""Porting specs: every emitted section is decoded here with code written from the targets'
semantics (tests/decoders.py) and compared with the mask_mod; files, conformance and diff."""

import json
import os
import subprocess
import sys
from pathlib import Path

import decoders
import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")  # a dev dependency; `make test` installs it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention.flex_attention import and_masks, or_masks

from helpers import resolve, variants
from run_triton_corpus import case_ids as triton_corpus_ids
from workbench import Mask, library, make
from workbench.blocks import build_block_mask, dense_mask
from workbench.cli import main
from workbench.define import WorkbenchError, with_score
from workbench.export import build_spec, conformance, diff_specs, load_spec, write_spec

TRITON_CORPUS_IDS = triton_corpus_ids()
ROOT = Path(__file__).resolve().parents[1]


def check_every_section(spec, mask):
    """Decode each section of `spec` independently and compare with `mask` bit for bit."""
    doc, tensors = spec.doc, spec.tensors
    q_len, kv_len = doc["shape"]["q_len"], doc["shape"]["kv_len"]
    checked = []
    for target, section in doc["backends"].items():
        if target in ("triton", "triton_attention", "flash_attn_cute"):  # checked by running them (test_port.py, test_fa4.py)
            continue
        for b, h, s in variants(section, doc["shape"]["B"], doc["shape"]["H"]):
            s = resolve(s, tensors)
            want = dense_mask(mask, (0, q_len), (0, kv_len), batch=[b], heads=[h])[0, 0]
            if target == "flash_attn":
                got = decoders.flash_attn(s, q_len, kv_len)
            elif target == "vllm_triton":
                got = decoders.vllm_triton(s, q_len, kv_len)
            elif target == "magi":
                got = decoders.magi(s, q_len, kv_len)
            elif target == "flashmask":
                got = decoders.flashmask(s, s["startend_row_indices"], q_len, kv_len)
            elif target == "row_intervals":
                got = decoders.row_intervals(s["rows"], q_len, kv_len)
            elif target == "block_sparse":
                got = decoders.block_sparse(s, q_len, kv_len, want)
            assert torch.equal(got, want), f"{target} (b={b}, h={h}) does not reproduce {mask.name}"
            checked.append(target)
    return set(checked)


LIBRARY_SIZES = [(203, 203), (77, 301)]


@pytest.mark.parametrize("q_len,kv_len", LIBRARY_SIZES)
@pytest.mark.parametrize("name", [n for n, f in library().items() if make(f).mask_mod is not None])
def test_library_spec_sections_reconstruct(name, q_len, kv_len):
    try:
        mask = make(name, q_len=q_len, kv_len=kv_len)
    except WorkbenchError:
        pytest.skip(f"{name} has no default at {q_len}x{kv_len}")
    spec = build_spec(mask, q_len, kv_len, golden=False, generalize=False)
    checked = check_every_section(spec, mask)
    assert {"row_intervals", "block_sparse", "magi"} <= checked
    assert set(spec.unsupported) | set(spec.supported) == {"flash_attn", "vllm_triton", "magi", "flashmask",
                                                            "row_intervals", "block_sparse", "triton",
                                                            "triton_attention", "flash_attn_cute"}
    assert "flash_attn_cute" in spec.supported, spec.unsupported.get("flash_attn_cute")


def test_expected_backends_and_reasons():
    def spec_of(name, params=None, n=256):
        return build_spec(make(name, params or {}, q_len=n, kv_len=n), n, n, golden=False)
    causal = spec_of("causal")
    fa = causal.doc["backends"]["flash_attn"]
    assert fa["causal"] and fa["window_size"] == [-1, -1] and fa["cu_seqlens_q"] is None
    assert fa["generalizes"]["parametric"] is True and len(fa["generalizes"]["checked_sizes"]) == 4
    assert causal.doc["pattern"] == {"kind": "causal", "params": {"align": "bottom_right"}}
    doc = spec_of("document", {"doc_lengths": [100, 56, 100]}).doc
    assert doc["backends"]["flash_attn"]["cu_seqlens_q"] == [0, 100, 156, 256]
    assert doc["pattern"]["kind"] == "document"
    chunked = spec_of("chunked_local", {"chunk": 64}).doc["backends"]["flash_attn"]
    assert chunked["attention_chunk"] == 64 and chunked["causal"]
    spans = spec_of("image_spans", {"spans": [[10, 30], [100, 140]]}).doc
    assert spans["backends"]["vllm_triton"]["mm_prefix_ranges"] == [[10, 30], [100, 140]]
    assert "flash_attn" in spans["unsupported"] and spans["pattern"]["kind"] == "spans_in_causal"
    rswa = spec_of("rswa", {"prefix_len": 16, "window": 32}).doc["backends"]["vllm_triton"]
    assert rswa["rswa"] == {"prefix_len": 16, "window": 32}
    assert spec_of("prefix_lm", {"prefix_len": 40}).doc["pattern"] == {"kind": "prefix_lm", "params": {"prefix_len": 40}}
    for name in ("dilated_window", "neighborhood_2d"):
        s = spec_of(name)
        assert "flash_attn" not in s.supported and "more than one run of keys" in s.unsupported["flash_attn"]
        assert "vllm_triton" not in s.supported
    top_left = build_spec(make("causal", {"align": "top_left"}), 100, 160, golden=False)
    assert top_left.doc["pattern"] == {"kind": "causal", "params": {"align": "top_left"}}
    assert "flash_attn" in top_left.unsupported  # FA's causal is bottom-right


def test_per_head_spec_uses_by_head():
    mask = make("per_head_window", {"windows": [8, 64, 1]})
    spec = build_spec(mask, 128, 128, golden=False)
    assert spec.doc["shape"]["H"] == 3 and spec.doc["pattern"]["kind"] == "per_head"
    windows = [s["window_size"][0] for s in spec.doc["backends"]["flash_attn"]["by_head"]]
    assert windows == [7, 63, 0]  # window w keeps distances 0 .. w - 1
    assert check_every_section(spec, mask) >= {"flash_attn", "flashmask"}


def test_score_probing_finds_the_forms():
    base = make("causal")
    alibi = make("alibi", {"num_heads": 4})
    s = build_spec(with_score(base, alibi), 96, 96, heads=4, golden=False).doc
    assert s["score"]["kind"] == "alibi"
    np.testing.assert_allclose(s["score"]["slopes"], alibi.data["slope"].numpy(), rtol=1e-6)
    assert s["backends"]["flash_attn"]["alibi_slopes"] == s["score"]["slopes"]
    soft = build_spec(with_score(base, make("softcap", {"cap": 20.0})), 96, 96, golden=False).doc
    assert soft["score"] == {"kind": "softcap", "cap": pytest.approx(20.0, rel=1e-5)}
    assert soft["backends"]["flash_attn"]["softcap"] == pytest.approx(20.0, rel=1e-5)
    assert soft["backends"]["vllm_triton"]["logits_soft_cap"] == pytest.approx(20.0, rel=1e-5)
    rel = make("relative_bias", {"max_distance": 5}, q_len=96, kv_len=96)
    spec = build_spec(with_score(base, rel), 96, 96, golden=False)
    assert spec.doc["score"]["kind"] == "relative_bias" and "flash_attn" not in spec.supported
    table, offset = spec.tensors["relative_bias_table"], spec.doc["score"]["offset"]
    d = np.arange(-95, 96)
    np.testing.assert_allclose(table[d + offset], rel.data["bias_table"].numpy()[np.clip(d, -5, 5) + 5], rtol=1e-6)
    head = make("head_bias", {"biases": [0.5, -1.0]})
    assert build_spec(with_score(base, head), 64, 64, heads=2, golden=False).doc["score"] == {
        "kind": "head_bias", "biases": [0.5, -1.0]}
    def positional(score, b, h, q_idx, kv_idx):
        return score * (1 + q_idx % 3)
    opaque = build_spec(Mask("p", mask_mod=base.mask_mod, score_mod=positional), 64, 64, golden=False).doc
    assert opaque["score"]["kind"] == "opaque" and "neither additive" in opaque["score"]["reason"]
    assert "flash_attn" in opaque["unsupported"]


# ---------------------------------------------------------------- property tests

@st.composite
def compositions(draw):
    n = draw(st.integers(8, 160))
    kv = draw(st.sampled_from([n, n + draw(st.integers(1, 40))]))
    d = kv - n

    def window():
        left, right = draw(st.integers(0, 40)), draw(st.integers(0, 40))
        return lambda b, h, q, k: (k >= q + d - left) & (k <= q + d + right)

    def causal():
        return lambda b, h, q, k: k <= q + d

    def prefix():
        p = draw(st.integers(0, kv))
        return lambda b, h, q, k: k < p

    def document():
        cuts = sorted(set(draw(st.lists(st.integers(1, kv - 1), max_size=4)))) if kv > 1 else []
        ids = torch.zeros(kv, dtype=torch.int64)
        for c in cuts:
            ids[c:] += 1
        return lambda b, h, q, k: ids[(q + d).clamp(max=kv - 1)] == ids[k]

    def span():
        s = draw(st.integers(0, kv - 1))
        e = draw(st.integers(s, kv - 1))
        return lambda b, h, q, k: (q + d >= s) & (q + d <= e) & (k >= s) & (k <= e)

    def chunk():
        c = draw(st.integers(1, 64))
        return lambda b, h, q, k: torch.div(q + d, c, rounding_mode="floor") == torch.div(k, c, rounding_mode="floor")

    makers = [window, causal, prefix, document, span, chunk]
    parts = [draw(st.sampled_from(makers))() for _ in range(draw(st.integers(1, 3)))]
    mod = parts[0]
    for p in parts[1:]:
        mod = (and_masks if draw(st.booleans()) else or_masks)(mod, p)
    return Mask("composed", mask_mod=mod), n, kv


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_property_every_emitted_section_reconstructs(case):
    mask, q_len, kv_len = case
    spec = build_spec(mask, q_len, kv_len, golden=False, generalize=False)
    check_every_section(spec, mask)
    for target, reason in spec.unsupported.items():
        assert reason and target not in spec.supported


def test_no_dense_kernel_for_dilated_and_2d_neighborhood():
    for mask in (make("dilated_window", {"window": 64, "dilation": 3}),
                 make("neighborhood_2d", {"width": 16, "kernel": 5}, q_len=256, kv_len=256)):
        spec = build_spec(mask, 256, 256, golden=False)
        assert "flash_attn" in spec.unsupported and "vllm_triton" in spec.unsupported
        assert "keep more than one run" in spec.unsupported["flash_attn"]
        check_every_section(spec, mask)


def test_flex_block_tensors_rebuild_the_block_mask():
    from torch.nn.attention.flex_attention import BlockMask

    mask = make("document", {"doc_lengths": [300, 212]}, q_len=512, kv_len=512)
    spec = build_spec(mask, 512, 512, golden=False)
    flex = resolve(spec.doc["backends"]["block_sparse"]["flex"], spec.tensors)
    rebuilt = BlockMask.from_kv_blocks(*(torch.from_numpy(np.asarray(flex[k]))[None, None] for k in
                                         ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")),
                                       BLOCK_SIZE=tuple(flex["BLOCK_SIZE"]), mask_mod=mask.mask_mod)
    ours = build_block_mask(mask, 512, 512)
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(rebuilt, field), getattr(ours, field)), field


# ---------------------------------------------------------------- files, conformance, diff

@pytest.fixture(scope="module")
def spans_spec(tmp_path_factory):
    out = tmp_path_factory.mktemp("specs")
    mask = make("image_spans", {"spans": [[8, 23], [60, 90]]}, q_len=128, kv_len=128)
    spec = build_spec(mask, 128, 128, heads=2, seed=7)
    json_path, _ = write_spec(spec, out)
    return json_path, mask


def test_write_load_roundtrip_and_golden(spans_spec):
    path, mask = spans_spec
    spec = load_spec(path)
    g = spec.doc["golden"]
    assert g["seeds"] == [7, 8] and g["reference_dtype"] == "float64" and g["shapes"]["q"] == [1, 2, 128, 64]
    q, k, v, out = (torch.from_numpy(spec.tensors[f"golden.0.{x}"]) for x in ("q", "k", "v", "out"))
    keep = dense_mask(mask, (0, 128), (0, 128))[0, 0]
    s = (q.double() @ k.double().transpose(-1, -2)) / 8
    want = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.double()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert (q != 0).all()


def _port_dense_sdpa(q, k, v, spec):
    """A port with plain SDPA and a dense mask read from the spec's row intervals."""
    rows = spec["backends"]["row_intervals"]["rows"]
    keep = decoders.row_intervals(rows, spec["shape"]["q_len"], spec["shape"]["kv_len"])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _port_vllm_reading(q, k, v, spec):
    keep = decoders.vllm_triton(spec["backends"]["vllm_triton"], spec["shape"]["q_len"], spec["shape"]["kv_len"])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _port_off_by_one(q, k, v, spec):
    keep = decoders.vllm_triton(spec["backends"]["vllm_triton"], spec["shape"]["q_len"], spec["shape"]["kv_len"])
    keep[:, 1:] |= keep[:, :-1].clone()  # each row sees one key too many
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_conformance_pass_fail_and_broken_impls(spans_spec):
    path, _ = spans_spec
    assert conformance(path, _port_dense_sdpa).passed
    assert conformance(path, _port_vllm_reading).passed
    bad = conformance(path, _port_off_by_one)
    assert not bad.passed and bad.to_frame()["rel_err"].min() > 1e-3
    raises = conformance(path, lambda q, k, v, spec: 1 / 0)
    assert not raises.passed and "ZeroDivisionError" in raises.rows[0]["message"]
    wrong = conformance(path, lambda q, k, v, spec: q[..., :3])
    assert not wrong.passed and "want a tensor of shape" in wrong.rows[0]["message"]
    nan = conformance(path, lambda q, k, v, spec: torch.full_like(q, float("nan")))
    assert not nan.passed and nan.rows[0]["nan_count"] > 0
    bf16 = conformance(path, lambda q, k, v, spec: _port_dense_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), spec))
    assert bf16.passed, bf16.to_frame()  # judged at bf16 tolerance


def test_cli_export_conformance_diff(tmp_path):
    port = tmp_path / "port.py"
    port.write_text("import torch\n\ndef port(q, k, v, spec):\n"
                    "    fa = spec['backends']['flash_attn']\n"
                    "    L = spec['shape']['q_len']\n"
                    "    i = torch.arange(L)[:, None]; j = torch.arange(L)[None, :]\n"
                    "    keep = (j <= i) & (j >= i - fa['window_size'][0])\n"
                    "    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)\n")
    for window in (16, 17):
        assert main(["export", "causal_sliding_window", "--param", f"window={window}", "--q-len", "96",
                     "--device", "cpu", "-o", str(tmp_path / f"w{window}")]) == 0
    a = next((tmp_path / "w16").glob("causal_sliding_window_16-*.spec.json"))
    b = next((tmp_path / "w17").glob("causal_sliding_window_17-*.spec.json"))
    assert main(["conformance", str(a), "--impl", f"{port}:port"]) == 0
    assert main(["conformance", str(b), "--impl", f"{port}:port"]) == 0
    assert main(["diff", str(a), str(a)]) == 0
    d = diff_specs(a, b)
    assert not d.same and d.differing_pairs == 96 - 16  # one more key for every row that reaches that far
    assert d.examples[0] == {"b": 0, "h": 0, "q": [16, 17], "kv": [0, 1], "kept_by": d.b}
    assert d.b.startswith(b.name) and "window=17" in d.b
    assert main(["diff", str(a), str(b)]) == 1


def test_bad_spec_files_give_named_errors(spans_spec, tmp_path):
    path, _ = spans_spec
    doc = json.loads(path.read_text())
    st_file = path.with_name(doc["tensor_file"])
    target = tmp_path / path.name
    (tmp_path / st_file.name).write_bytes(st_file.read_bytes())

    def broken(mutate, match):
        d = json.loads(path.read_text())
        mutate(d)
        target.write_text(json.dumps(d))
        with pytest.raises(WorkbenchError, match=match):
            load_spec(target)

    target.write_text("{not json")
    with pytest.raises(WorkbenchError, match="not valid JSON"):
        load_spec(target)
    broken(lambda d: d["backends"]["vllm_triton"].update(attn_type="sideways"), "backends/vllm_triton")
    broken(lambda d: d["shape"].update(q_len=-4), "shape/q_len")
    broken(lambda d: d["backends"]["block_sparse"].update(indptr={"$tensor": "nope"}), "references tensor 'nope'")
    broken(lambda d: d["shape"].update(q_len=100), "row_intervals/rows")
    broken(lambda d: d.pop("golden"), "golden")
    # a pickle where the tensors should be is refused, not unpickled
    (tmp_path / st_file.name).write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    target.write_text(path.read_text())
    with pytest.raises(WorkbenchError, match="not a readable safetensors file"):
        load_spec(target)


SPEC_CASES = (("document", {"doc_lengths": [40, 30, 30]}, 100), ("tree", {}, 15),
              ("dilated_window", {"window": 32, "dilation": 3}, 90), ("neighborhood_2d", {"width": 10, "kernel": 3}, 100))


@pytest.fixture(scope="module")
def triton_specs(tmp_path_factory):
    """Specs of four library masks, their generated Triton run from the spec files alone in one
    fresh process under TRITON_INTERPRET=1, as a porting engineer would run it."""
    pytest.importorskip("triton")
    tmp_path = tmp_path_factory.mktemp("specs")
    specs = []
    for name, params, n in SPEC_CASES:
        mask = make(name, params, q_len=n, kv_len=n)
        spec = build_spec(with_score(mask, make("relative_bias", {"max_distance": 4}, q_len=n, kv_len=n))
                          if name == "tree" else mask, n, n, golden=False)
        assert "triton" in spec.supported, spec.unsupported.get("triton")
        json_path, _ = write_spec(spec, tmp_path)
        np.save(tmp_path / f"{spec.name}.want.npy", dense_mask(mask, (0, n), (0, n))[0, 0].numpy())
        specs.append(str(json_path))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "run_triton_spec.py"), "cpu", *specs],
                         capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("OK ", "FAIL "))]
    assert len(lines) == len(specs), out.stdout + out.stderr
    return dict(zip([c[0] for c in SPEC_CASES], lines))


@pytest.mark.parametrize("name", [c[0] for c in SPEC_CASES])
def test_triton_source_matches_the_mask_in_the_interpreter(triton_specs, name):
    """The spec's Triton equals the mask (and its score) on every pair, one test per spec."""
    assert triton_specs[name].startswith("OK "), triton_specs[name]


def test_batch_dependent_mask_uses_by_batch():
    cuts = torch.tensor([40, 90])  # batch entry b: one document boundary at cuts[b]

    def per_batch_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx < cuts[b]) == (kv_idx < cuts[b]))

    mask = Mask("per_batch_documents", mask_mod=per_batch_documents, data={"cuts": cuts})
    spec = build_spec(mask, 128, 128, batch=2, golden=False)
    assert spec.doc["shape"]["B"] == 2 and spec.doc["shape"]["H"] is None
    segments = [s["cu_seqlens_q"] for s in spec.doc["backends"]["flash_attn"]["by_batch"]]
    assert segments == [[0, 40, 128], [0, 90, 128]]
    assert check_every_section(spec, mask) >= {"flash_attn", "magi", "row_intervals", "block_sparse"}


def test_score_that_varies_by_batch_entry_is_opaque():
    per_entry = torch.tensor([0.0, 2.0])

    def batch_bias(score, b, h, q_idx, kv_idx):
        return score + per_entry[b]

    mask = Mask("batch_bias", mask_mod=make("causal").mask_mod, score_mod=batch_bias, data={"b": per_entry})
    assert build_spec(mask, 64, 64, batch=2, golden=False).doc["score"]["kind"] == "opaque"
    assert build_spec(mask, 64, 64, golden=False).doc["score"] == {"kind": "none"}  # batch entry 0 adds 0


def test_bad_input_to_export_conformance_and_diff(tmp_path, capsys):
    with pytest.raises(WorkbenchError, match="would list .* pairs per head.*Fix:"):
        build_spec(make("causal"), 1 << 15, 1 << 15)
    assert main(["conformance", str(tmp_path / "missing.spec.json"), "--impl", "x.py:f"]) == 2
    assert "no spec file" in capsys.readouterr().err
    a = write_spec(build_spec(make("causal"), 64, 64, golden=True, seed=0), tmp_path / "a")[0]
    b = write_spec(build_spec(make("causal"), 96, 96, golden=True, seed=0), tmp_path / "b")[0]
    assert a.name != b.name and a.name.startswith("causal_bottom_right-")  # other lengths, other files
    d = diff_specs(a, b)
    assert not d.same and "lengths differ" in d.line and "export both with the same --q-len" in d.line and d.differing_pairs is None
    assert main(["export", "causal", "--q-len", "64", "--device", "cpu", "-o", str(a / "x")]) == 2
    assert "cannot write to" in capsys.readouterr().err


@pytest.fixture(scope="module")
def triton_corpus():
    """One fresh interpreter process translates and runs every corpus mod; each is judged below."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "run_triton_corpus.py"), "cpu"], capture_output=True,
                         text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    results = {line.split()[1]: line for line in out.stdout.splitlines() if line.startswith("CASE ")}
    assert results, out.stdout[-4000:] + out.stderr[-4000:]
    return results


@pytest.mark.parametrize("case", TRITON_CORPUS_IDS)
def test_triton_translation_covers_the_corpus_in_the_interpreter(triton_corpus, case):
    """Every mod of the corpus (library, user-style and attention-gym-style mods) is translated to
    Triton and equals torch on every pair, head and batch entry (a fresh process under
    TRITON_INTERPRET=1), one test per mod."""
    line = triton_corpus.get(case)
    assert line is not None, f"{case} did not run"
    assert line.split()[2] == "OK", line


def test_backends_table_shows_arguments_and_whole_reasons():
    spec = build_spec(make("causal_sliding_window", {"window": 100}), 256, 256, golden=False, generalize=False)
    frame = spec.backends_frame()
    assert '"window_size": [99, 0]' in frame.loc["flash_attn", "arguments"]
    tree = build_spec(make("tree", q_len=256, kv_len=256), 256, 256, golden=False, generalize=False)
    reason = tree.backends_frame().loc["flash_attn", "reason"]
    assert len(reason) > 50 and reason in tree.backends_view().to_html()  # in full, not cut at 50
