"""Starting Ray for the workbench: locally (a sweep, a split reference) or joining a cluster. A
local start that times out on a busy machine is tried again, then explained; a missing Ray names
the extra that installs it."""

from __future__ import annotations

import time

from workbench.define import WorkbenchError

__all__ = ["import_ray", "init_ray", "RAY_START_TRIES"]


# Ray gives a new local node 30 s to register (a constant in Ray); on a busy 2-core machine its
# processes can take longer to start. A failed start is retried this many times before giving up.
RAY_START_TRIES = 3


def import_ray(extra: str = "sweep"):
    """Ray, or a WorkbenchError naming the extra that installs it."""
    try:
        import ray
    except ModuleNotFoundError:
        raise WorkbenchError("this needs Ray, which is not installed",
                             f"pip install 'flex-workbench[{extra}]' (or pip install 'ray>=2.9')") from None
    return ray


def init_ray(address: str | None = None, **options):
    """ray.init with the workbench's settings (no dashboard, workers' logs kept out of the
    terminal); a local start that times out (a loaded machine) is tried again, then reported as
    a WorkbenchError that says what to do. Returns the ray module."""
    ray = import_ray()
    last = None
    for attempt in range(1 if address else RAY_START_TRIES):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     **options)
            return ray
        except Exception as exc:  # Ray raises a bare Exception when its node times out
            last = exc
            try:
                ray.shutdown()
            except Exception:
                pass
            time.sleep(2 * (attempt + 1))
    text = str(last).splitlines()[0][:300] if str(last) else type(last).__name__
    if address:
        raise WorkbenchError(f"could not join the Ray cluster at {address}: {text}",
                             "check the address (ray://HOST:10001 or auto) and that the cluster is up") from None
    raise WorkbenchError(f"Ray could not start on this machine ({RAY_START_TRIES} tries): {text}",
                         "the machine is probably too busy for Ray's processes to start in time: retry when it is "
                         "less loaded, or start Ray once yourself (`ray start --head`) and pass --address auto, or "
                         "run without workers") from None
