"""A mask written the way FlexAttention cannot trace (a Python `if` on index tensors): the small
sweep includes it on purpose, to show how a failing case is recorded."""


def branchy_window(window=16):
    def branchy_window_mask(b, h, q_idx, kv_idx):
        if q_idx - kv_idx < window:  # should be a tensor expression: (q_idx - kv_idx < window) & ...
            return kv_idx <= q_idx
        return q_idx < 0
    return branchy_window_mask
