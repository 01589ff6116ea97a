def band(width):
    def banded(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < width
    return banded
