"""Real-world inputs: attention-gym's own factories (the installed attn-gym package, a dev
dependency), driven from the command line as `module:function` targets with JSON parameters --
tensors and mods included -- through blocks, verify and export."""

import pytest

from workbench.cli import main

pytest.importorskip("attn_gym")

# (target, parameters, q_len, kv_len): every attn-gym factory that builds a mask or score at a small size
GYM_MASKS = [
    ("attn_gym.masks.causal:causal_mask", [], 100, 100),
    ("attn_gym.masks.sliding_window:generate_sliding_window", ["window_size=16"], 100, 100),
    ("attn_gym.masks.dilated_sliding_window:generate_dilated_sliding_window", ["window_size=16", "dilation=2"], 100, 100),
    ("attn_gym.masks.prefix_lm:generate_prefix_lm_mask", ["prefix_length=20"], 100, 100),
    ("attn_gym.masks.natten:generate_natten", ["canvas_w=10", "canvas_h=10", "kernel_w=3", "kernel_h=3"], 100, 100),
    ("attn_gym.masks.natten:generate_tiled_natten", ["W=8", "H=8", "K_W=3", "K_H=3", "T_W=2", "T_H=2"], 64, 64),
    ("attn_gym.masks.natten:generate_morton_natten", ["canvas_w=8", "canvas_h=8", "kernel_w=3", "kernel_h=3"], 64, 64),
    # a factory that takes another mod (named as a target) and a tensor (a JSON list)
    ("attn_gym.masks.document_mask:generate_doc_mask_mod",
     ["mask_mod=attn_gym.masks.causal:causal_mask", "offsets=[0,30,70,100]"], 100, 100),
    ("attn_gym.masks.document_mask:generate_packed_causal_doc_mask_mod", ["offsets=[0,30,70,100]"], 100, 100),
    ("attn_gym.masks.global_sliding_window:generate_global_sliding_window",
     ["window_size=8", "is_global=[true,false,false,true,false,false,false,false,false,false]"], 10, 10),
    ("attn_gym.masks.block_diffusion:generate_block_diffusion_mask", ["seq_len=64", "block_size=16"], 128, 128),
    ("attn_gym.masks.jetspec:generate_jetspec_training_mask_mod", ["prefix_length=16", "block_size=8"], 64, 64),
    ("attn_gym.masks.sta:generate_sta_mask_mod_2d", ["canvas_hw=[8,8]", "kernel_hw=[4,4]", "tile_hw=[2,2]"], 64, 64),
    ("attn_gym.masks.flamingo:generate_vision_cross_attention_mask_mod",
     ["intervals=[[0,10],[10,20]]", "image_token_length=4"], 20, 8),
    ("attn_gym.masks.shared_prefix:generate_shared_prefix_mask_mod",
     ["offsets=[0,20,40,60]", "prefix_document_id=[0,0,0]"], 60, 60),
    ("attn_gym.masks.svg:generate_spatial_head_mask_mod", ["prompt_length=8", "num_frames=4", "token_per_frame=16"],
     72, 72),
    ("attn_gym.masks.vsa:generate_vsa_padding_mask_mod", ["variable_block_sizes=[4,4,2]", "tile_numel=4"], 12, 12),
    ("attn_gym.masks.jetspec:generate_jetspec_tree_causal_mask_mod",
     ["prefix_length=4", "ancestor_matrix=[[1,0,0],[1,1,0],[1,0,1]]"], 3, 7),
]
GYM_SCORES = [
    ("attn_gym.mods.alibi:generate_alibi_bias", ["H=4"], 4),
    ("attn_gym.mods.softcapping:generate_tanh_softcap", ["soft_cap=20"], 1),
    ("attn_gym.mods.sandwich:generate_sandwich_bias", ["H=4", "max_seq_len=64"], 4),
    ("attn_gym.mods.activation:generate_activation_score_mod", [], 1),
    # per-head bias table by shortest-path distance of one graph (a per-sample table, batch 1)
    ("attn_gym.mods.graphormer:generate_graphormer_spatial_bias",
     ["spatial_bias=[[0.1,0.2,0.3],[0.4,0.5,0.6]]", "distances=[[[0,1,2],[1,0,1],[2,1,0]]]"], 2),
]


def params(items, flag="--param"):
    return [x for item in items for x in (flag, item)]


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out + err


@pytest.mark.parametrize("target,items,q_len,kv_len", GYM_MASKS, ids=[t.split(":")[1] for t, *_ in GYM_MASKS])
def test_attn_gym_mask_through_blocks_verify_export(capsys, tmp_path, target, items, q_len, kv_len):
    sizes = ["--q-len", q_len, "--kv-len", kv_len, "--device", "cpu"]
    rc, text = run(capsys, "blocks", target, *params(items), *sizes, "--json")
    assert rc == 0, text
    rc, text = run(capsys, "verify", target, *params(items), *sizes, "--eager", "--dtype", "float32",
                   "--head-dim", 16)
    assert rc == 0 and text.startswith("PASS"), text
    rc, text = run(capsys, "export", target, *params(items), *sizes, "--head-dim", 16, "-o", tmp_path)
    assert rc == 0 and "wrote" in text, text


@pytest.mark.parametrize("target,items,heads", GYM_SCORES, ids=[t.split(":")[1] for t, *_ in GYM_SCORES])
def test_attn_gym_score_mods_verify_and_export(capsys, tmp_path, target, items, heads):
    q_len = 3 if "graphormer" in target else 64  # the graph has 3 nodes
    base = ["causal", "--score", target, *params(items, "--score-param"), "--q-len", q_len, "--heads", heads,
            "--device", "cpu"]
    rc, text = run(capsys, "verify", *base, "--eager", "--dtype", "float32", "--head-dim", 16)
    assert rc == 0 and text.startswith("PASS"), text
    rc, text = run(capsys, "export", *base, "--head-dim", 16, "-o", tmp_path)
    assert rc == 0, text


def test_attn_gym_alibi_is_recognised_as_flash_attention_alibi(capsys, tmp_path):
    """Probed on the pairs a causal mask keeps, attention-gym's alibi is FlashAttention's."""
    rc, text = run(capsys, "export", "causal", "--score", "attn_gym.mods.alibi:generate_alibi_bias", "--score-param",
                   "H=4", "--q-len", 64, "--heads", 4, "--device", "cpu", "--head-dim", 16, "-o", tmp_path)
    assert rc == 0 and "score: alibi" in text and "flash_attn" in text.split("exact on:")[1].splitlines()[0], text
