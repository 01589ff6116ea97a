import torch

from workbench import Mask


def head_bias(biases: list[float] | None = None, device=None) -> Mask:
    """A constant bias per head: score' = score + bias[h] (a per-head temperature offset; the
    simplest learnable score_mod, used to test gradient flow into captured tensors). Default:
    eight biases from -1 to 1."""
    biases = list(biases or torch.linspace(-1.0, 1.0, 8).tolist())
    bias_of_head = torch.tensor(biases, dtype=torch.float32, device=device or "cpu")

    def head_bias_score(score, b, h, q_idx, kv_idx):
        return score + bias_of_head[h]

    return Mask(name=f"head_bias_{len(biases)}heads", score_mod=head_bias_score, params=dict(biases=biases),
                description=head_bias.__doc__, data=dict(bias_of_head=bias_of_head), heads=len(biases))
