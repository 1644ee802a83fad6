"""``elastictk-run``'s command line: torchrun's flags parsed into a validated :class:`LaunchConfig`.

``parse_args(argv)`` returns the config or raises :class:`UsageError` (one line);
``parse_or_exit(argv)`` prints that line argparse-style and exits 2, for a ``main``.
"""
from .args import build_parser, parse_args, parse_or_exit
from .resolve import config_from_namespace
from .config import LaunchConfig, check_system, validate
from .values import Std, UsageError

__all__ = [
    "LaunchConfig", "Std", "UsageError", "build_parser", "check_system", "config_from_namespace",
    "parse_args", "parse_or_exit", "validate",
]
