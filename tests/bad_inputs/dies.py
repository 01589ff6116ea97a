"""A factory that kills its process (as an out-of-memory kill would): a sweep records it and goes on."""
import os


def dies(q_len=None, kv_len=None):
    os._exit(3)
