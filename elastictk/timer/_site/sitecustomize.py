"""elastictk's interpreter-start hook for subprocess workers (on PYTHONPATH only when the agent
asked for collective timeouts or named worker hooks): step aside for the sitecustomize it
shadows, then activate.

Kept dependency-free and failure-proof: nothing here may stop the worker from starting.
"""
import os
import sys


def _elastictk_boot() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.realpath(p) != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401  (the one we shadowed, if any)
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
    # The worker hooks the launcher named (the metrics' optimizer-step count, which the
    # progress watchdog reads), as elastictk/supervisor/child.py does in forked workers; only
    # in a worker (the agent and its fork server inherit PYTHONPATH too). Activating twice (a
    # fault plan's sitecustomize does it as well) is harmless.
    if "RANK" not in os.environ or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    import importlib

    for name in os.environ.get("ELASTICTK_WORKER_HOOKS", "").split(","):
        if name.strip().startswith("elastictk."):
            try:
                importlib.import_module(name.strip()).activate_from_env()
            except Exception as e:  # noqa: BLE001 - a hook must never stop the worker
                print(f"elastictk: worker hook {name} is off: {e!r}", file=sys.stderr)


_elastictk_boot()
del _elastictk_boot
