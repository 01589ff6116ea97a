"""Candidate implementations for conformance, good and bad."""

import sys
import time

import torch
import torch.nn.functional as F


def reference_causal(q, k, v, spec):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def zeros(q, k, v, spec):
    return torch.zeros_like(q)


def raises(q, k, v, spec):
    raise RuntimeError("kernel launch failed")


def wrong_shape(q, k, v, spec):
    return q[..., :1]


def returns_none(q, k, v, spec):
    return None


def returns_nan(q, k, v, spec):
    return torch.full_like(q, float("nan"))


def returns_meta(q, k, v, spec):
    return torch.empty_like(q, device="meta")


def exits(q, k, v, spec):
    sys.exit(0)


def hangs(q, k, v, spec):
    while True:
        time.sleep(0.05)
