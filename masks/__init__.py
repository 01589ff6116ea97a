"""The built-in mask library: one pattern per file, `masks/NAME.py` defines factory `NAME`.

Conventions shared by every pattern:
- mods are plain FlexAttention functions, `mask_mod(b, h, q_idx, kv_idx) -> bool` and
  `score_mod(score, b, h, q_idx, kv_idx) -> score`, named after what they do;
- when Lq != Lk, query i sits at position i + (Lk - Lq): queries are the last Lq tokens of the
  key sequence (bottom-right alignment, as in FlashAttention and chunked prefill). Only
  `causal(align="top_left")` differs;
- factories take `q_len` / `kv_len` / `device` keywords when the pattern needs them; the
  workbench fills them in, and they are not parameters;
- a module may list VARIANTS (parameter dicts) that the report shows besides the defaults.
"""
