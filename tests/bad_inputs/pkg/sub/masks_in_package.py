"""A target inside a package that imports its package's helpers (needs the package root)."""
from pkg.helpers import band


def package_band(width: int = 8):
    return band(width)
