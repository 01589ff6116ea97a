"""User files with mistakes (and tricky but valid mods) for tests/test_bad_input.py."""

import sys

import numpy as np
import torch

table10 = torch.zeros(10, dtype=torch.bool)
array = np.arange(64)
calls = [0]


def python_if(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return q_idx >= 0
    return q_idx < 0


def item_call(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx.item()


def int_result(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).to(torch.int32)


def wrong_shape(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx).expand(3)


def short_table(b, h, q_idx, kv_idx):
    return table10[q_idx] | (kv_idx <= q_idx)


def numpy_table(b, h, q_idx, kv_idx):
    return array[q_idx] >= kv_idx


def random_mask(b, h, q_idx, kv_idx):
    return torch.rand(()) > 0.5


def changing_global(b, h, q_idx, kv_idx):
    calls[0] += 1
    return q_idx + calls[0] % 5 >= kv_idx


def five_arg_mask(b, h, q_idx, kv_idx, extra):
    return q_idx >= kv_idx


def three_arg_mask(h, q_idx, kv_idx):
    return q_idx >= kv_idx


def star_args(*args):
    return args[2] >= args[3]


def bare_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def bool_score(score, b, h, q_idx, kv_idx):
    return score > 0


def per_head(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < torch.tensor([4, 8, 16, 32])[h]


def per_sample(b, h, q_idx, kv_idx):
    return kv_idx < torch.tensor([10, 50])[b]


def meta_table():
    table = torch.zeros(4, device="meta")

    def on_meta(score, b, h, q_idx, kv_idx):
        return score + table[h]
    return on_meta


def raising_factory():
    raise ValueError("width must be even")


def int_factory():
    return 3


def exiting_factory():
    sys.exit(0)


def stuck_factory():
    import time

    while True:  # waits forever (on a lock, a socket...): the report must give up on it
        time.sleep(0.05)


def fine_factory(width: int = 16):
    def banded(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < width
    return banded


def windows_factory(left: list = (1, 2)):
    def windowed(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < len(left)
    return windowed


def named_factory(kind: str = "causal"):
    def named(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if kind == "causal" else q_idx >= 0
    return named


def needs_args(width):
    def banded(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < width
    return banded
