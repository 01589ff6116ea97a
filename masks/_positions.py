"""Helpers shared by the library factories (not by the mods themselves)."""


def query_offset(q_len, kv_len):
    """Position of query 0 among the keys: queries are the last q_len tokens (bottom-right)."""
    if q_len is None or kv_len is None:
        return 0
    if kv_len < q_len:
        raise ValueError(f"kv_len ({kv_len}) < q_len ({q_len}): queries are the last q_len tokens "
                         "of the key sequence, so kv_len must be at least q_len")
    return kv_len - q_len


def sequence_length(q_len, kv_len, default):
    """Length of the token sequence a table must cover."""
    return kv_len if kv_len is not None else (q_len if q_len is not None else default)
