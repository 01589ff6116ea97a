"""Run a porting spec's generated Triton the way a backend engineer would: from the spec files
alone. Usage: python tests/run_triton_spec.py DEVICE SPEC.json [...]; prints OK/FAIL per spec.

Next to each spec a NAME.want.npy holds the mask to compare with. With TRITON_INTERPRET=1 it
runs on the CPU."""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file


def load_module(source: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    device, paths = sys.argv[1], sys.argv[2:]
    failed = 0
    for n, path in enumerate(paths):
        path = Path(path)
        doc = json.loads(path.read_text())
        tensors = load_file(str(path.with_name(doc["tensor_file"])))
        tri = doc["backends"]["triton"]
        module = load_module(tri["source"], f"spec_triton_{n}")
        pointers = {p: torch.from_numpy(tensors[ref["$tensor"]]).to(device) for p, ref in tri["pointers"].items()}
        q_len, kv_len = doc["shape"]["q_len"], doc["shape"]["kv_len"]
        out = torch.zeros(q_len, kv_len, dtype=torch.int8, device=device)
        block = 32
        grid = (-(-q_len // block), -(-kv_len // block))
        mask_ptrs = [pointers[a] for a in tri["mask_args"][4:]]
        getattr(module, tri["grid_kernel"])[grid](out, 0, 0, q_len, kv_len, *mask_ptrs, BLOCK_Q=block, BLOCK_K=block)
        want = np.load(path.with_name(f"{doc['name']}.want.npy"))
        ok = np.array_equal(out.bool().cpu().numpy(), want)
        if ok and tri["score_fn"]:
            score = torch.randn(q_len, kv_len, device=device)
            got = torch.empty_like(score)
            score_ptrs = [pointers[a] for a in tri["score_args"][5:]]
            getattr(module, tri["score_grid_kernel"])[grid](score, got, 0, 0, q_len, kv_len, *score_ptrs,
                                                           BLOCK_Q=block, BLOCK_K=block)
            s = doc["score"]
            if s["kind"] == "relative_bias":  # check against the spec's own reading of the score
                table = torch.from_numpy(tensors[s["table"]["$tensor"]]).to(device)
                i = torch.arange(q_len, device=device)[:, None]
                j = torch.arange(kv_len, device=device)[None, :]
                expected = score + table[i + kv_len - q_len - j + s["offset"]]
                ok = torch.allclose(got, expected, atol=1e-5)
        print(f"{'OK' if ok else 'FAIL'} {doc['name']}")
        failed += not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
