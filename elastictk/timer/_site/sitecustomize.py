"""elastictk's interpreter-start hook for subprocess workers (on PYTHONPATH only when the agent
asked for collective timeouts): step aside for the sitecustomize it shadows, then activate.

Kept dependency-free and failure-proof: nothing here may stop the worker from starting.
"""
import os
import sys


def _elastictk_boot() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.realpath(p) != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the one we shadowed, if any)
    except ModuleNotFoundError as e:
        if e.name != "sitecustomize":
            print(f"Error in sitecustomize: {e!r}", file=sys.stderr)
        if me is not None:
            sys.modules["sitecustomize"] = me
    except Exception as e:  # noqa: BLE001 - what site.py itself would do
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}",
              file=sys.stderr)
    try:
        from elastictk.timer.boot import activate_from_env
    except ImportError as e:
        print(f"elastictk.timer: collective timeouts are off in this worker: cannot import "
              f"elastictk ({e}); install elastictk in the worker's Python", file=sys.stderr)
        return
    activate_from_env()


_elastictk_boot()
del _elastictk_boot
