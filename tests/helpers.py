"""Helpers the tests share (one module; test modules never import each other)."""

import torch

# a BlockMask's eight tensors, as create_block_mask builds them
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def same_block_mask(ours, ref):
    """Every tensor of `ours` equals `ref`'s (broadcast axes compared by broadcasting)."""
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(ref, name)
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        a, b = torch.broadcast_tensors(a, b) if a.shape != b.shape else (a, b)
        assert torch.equal(a, b), name


def drop_one_full_block(bm, row, q_len, kv_len):
    """A broken BlockMask: row `row` loses its last full kv block."""
    from torch.nn.attention.flex_attention import BlockMask

    full_num = bm.full_kv_num_blocks.clone()
    full_num[..., row] -= 1  # indices are listed in ascending order: drops the last full block
    return BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, full_num, bm.full_kv_indices,
                                    BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod, seq_lengths=(q_len, kv_len))


def resolve(value, tensors):
    """A spec section with each {"$tensor": name} replaced by its array."""
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            return tensors[value["$tensor"]]
        return {k: resolve(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, tensors) for v in value]
    return value


def variants(section, B, H):
    """(b, h, section) for every variant a backend section covers."""
    if "by_batch" in section:
        for b, s in enumerate(section["by_batch"]):
            for _, h, ss in variants(s, None, H):
                yield b, h, ss
    elif "by_head" in section:
        for h, s in enumerate(section["by_head"]):
            yield 0, h, s
    else:
        yield 0, 0, section


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `python -m workbench ARGV`, run in this process."""
    from workbench.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def cli(capsys, *argv):
    """(exit code, stdout + stderr) of `python -m workbench ARGV`."""
    rc, out, err = run_cli(capsys, *argv)
    return rc, out + err
