"""Pure parsers for the values of ``elastictk-run``'s flags.

Each takes the raw text and a *label* naming where it came from (``--nnodes 3:2`` or
``PET_NNODES=3:2``), and either returns a typed value or raises :class:`UsageError` with one line
that names the input, says what is wrong and how to write it instead. No I/O happens here, so
hypothesis can drive these directly.
"""
from __future__ import annotations

import math
import re
import signal

from ..supervisor.spec import Std  # one definition: the launcher parses what the supervisor takes

#: rendezvous backends elastictk-run knows; ``etcd-v2`` is torchrun's spelling of the same thing.
BACKENDS = ("c10d", "file", "etcd", "static")
BACKEND_ALIASES = {"etcd-v2": "etcd"}
START_METHODS = ("spawn", "fork", "forkserver", "preload")
RECOVERY_MODES = ("restart-all", "in-place")
#: ``--hang-detection``: deadlines learned from the job's pace (agent/pace.py), the fixed
#: ``--progress-timeout`` on optimizer steps alone (before 0.2), or no progress watchdog.
HANG_MODES = ("learned", "fixed", "off")

#: ``--rdzv-conf`` keys and their value types. ``keep_alive_*`` are torchrun's names for the
#: heartbeat settings and are translated into ``heartbeat_*`` by :func:`parse_rdzv_conf`.
RDZV_CONF_KEYS: dict[str, type] = {
    "join_timeout": float,
    "last_call_timeout": float,
    "close_timeout": float,
    "timeout": float,
    "read_timeout": float,
    "is_host": bool,
    "heartbeat_interval": float,
    "heartbeat_timeout": float,
    "keep_alive_interval": float,
    "keep_alive_max_attempt": int,
}
#: torch's keep-alive interval when only ``keep_alive_max_attempt`` is given.
TORCH_KEEP_ALIVE_INTERVAL = 5.0

#: the longest ``--collective-timeout``: a collective stuck for longer than a day is a hang.
MAX_COLLECTIVE_TIMEOUT = 86400.0
#: ``--progress-timeout`` unless given, under ``--hang-detection fixed`` (under ``learned`` it is
#: the learned deadlines' ceiling): a frozen DDP rank ends in a recovery within minutes
#: (the backend's own timeout is 30), yet a long evaluation or checkpoint save between
#: optimizer steps rarely lasts this long (README "Hangs": why, and how to raise it).
DEFAULT_PROGRESS_TIMEOUT = 300.0
#: the longest ``--restart-backoff``: the agent's backoff grows from it up to 60 s, its cap.
MAX_RESTART_BACKOFF = 60.0
#: the longest job id, in UTF-8 bytes: it names ``<log_dir>/<id>[.N]``, one path component.
MAX_RUN_ID_BYTES = 128

_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")


class UsageError(ValueError):
    """Bad command-line input; ``str()`` is the one line printed after ``elastictk-run: error:``."""


class ArgvError(UsageError):
    """Command-line syntax that argparse itself refuses (an unknown flag, a missing value):
    where torch's ``main`` exits 2 through argparse instead of raising ``ValueError``."""


class EnvText(str):
    """A flag value that came from an environment variable; remembers which, for error lines."""

    env: str

    def __new__(cls, value: str, env: str) -> "EnvText":
        obj = super().__new__(cls, value)
        obj.env = env
        return obj


def label(flag: str, value: object) -> str:
    """How an error line names an input: ``--nnodes 3:2`` or ``PET_NNODES='3:2'``."""
    if isinstance(value, EnvText):
        return f"{value.env}={str(value)!r}"
    if isinstance(value, str) and not value.isprintable():  # a newline would split the line
        return f"{flag} {value!r}"
    return f"{flag} {value}" if value not in ("", None) else f"{flag} ''"


def parse_int(text: str, where: str, *, minimum: int | None = None) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a whole number") from None
    if minimum is not None and value < minimum:
        raise UsageError(f"{where}: must be at least {minimum}")
    return value


def parse_seconds(text: str, where: str, *, allow_zero: bool = False,
                  maximum: tuple[float, str] | None = None,
                  minimum: tuple[float, str] | None = None) -> float:
    """A finite number of seconds, more than 0 (or 0 too with ``allow_zero``); ``maximum`` is
    ``(bound, why and what to pass instead)``, for the settings a huge value breaks; ``minimum``
    the same for the settings a tiny one turns into a busy loop."""
    try:
        value = float(text.strip())
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "more than 0"
        raise UsageError(f"{where}: seconds must be a finite number {bound}")
    if maximum is not None and value > maximum[0]:
        raise UsageError(f"{where}: seconds must be at most {maximum[0]:g} {maximum[1]}")
    if minimum is not None and value < minimum[0]:
        raise UsageError(f"{where}: seconds must be at least {minimum[0]:g} {minimum[1]}")
    return value


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot be a job id, or None. The id is a directory name under
    ``--log-dir`` (``<log_dir>/<id>/attempt_N``) and the prefix of the job's store keys
    (``rdzv/<id>/...``), so it must be one plain path component."""
    fix = "use letters, digits, '-' and '_', e.g. job-1"
    if not run_id or "/" in run_id:
        return "the job id must be non-empty and contain no '/'"
    if run_id in (".", ".."):
        return f"{run_id!r} cannot be a job id: it becomes a directory name under --log-dir; {fix}"
    if not run_id.isprintable():
        return f"the job id holds a control character; {fix}"
    size = len(run_id.encode("utf-8", "surrogatepass"))
    if size > MAX_RUN_ID_BYTES:
        return (f"the job id is {size} bytes long, at most {MAX_RUN_ID_BYTES} fit in a log "
                f"directory name; give a shorter id")
    return None


def parse_bool(text: str, where: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise UsageError(f"{where}: {text!r} is not a boolean; use 1/0, true/false or yes/no")


def parse_port(text: str, where: str) -> int:
    port = parse_int(text, where)
    if not 0 <= port <= 65535:
        raise UsageError(f"{where}: port {port} is out of range 0-65535")
    return port


def parse_nnodes(text: str, where: str = "--nnodes") -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` into ``(min_nodes, max_nodes)`` with ``1 <= MIN <= MAX``."""
    fix = "use --nnodes N or --nnodes MIN:MAX (e.g. 2 or 1:4)"
    parts = text.split(":")
    if len(parts) > 2:
        raise UsageError(f"{where}: too many ':'; {fix}")
    numbers: list[int] = []
    for part in parts:
        try:
            numbers.append(int(part.strip()))
        except ValueError:
            raise UsageError(f"{where}: {part!r} is not a number of nodes; {fix}") from None
    lo, hi = numbers[0], numbers[-1]
    if lo < 1 or hi < 1:
        raise UsageError(f"{where}: node counts must be at least 1; {fix}")
    if lo > hi:
        raise UsageError(f"{where}: min {lo} > max {hi}: use --nnodes MIN:MAX with MIN <= MAX")
    return lo, hi


NPROC_WORDS = "cpu, gpu, xpu, auto or an accelerator backend's name"


def parse_nproc(text: str, where: str = "--nproc-per-node") -> int | str:
    """A positive int, or a device word (``cpu``, ``gpu``, ``xpu``, ``auto``, or the name of a
    PrivateUse1 backend), resolved later against the hardware, as torchrun resolves it."""
    word = text.strip().lower()
    if re.fullmatch(r"[a-z][a-z0-9_]*", word):
        return word
    try:
        n = int(word)
    except ValueError:
        raise UsageError(f"{where}: use a number of workers, or {NPROC_WORDS}") from None
    if n < 1:
        raise UsageError(f"{where}: need at least 1 worker per node")
    return n


def parse_backend(text: str, where: str = "--rdzv-backend") -> str:
    name = text.strip().lower()
    name = BACKEND_ALIASES.get(name, name)
    if name not in BACKENDS:
        raise UsageError(f"{where}: unknown rendezvous backend; use one of {', '.join(BACKENDS)}")
    return name


def parse_choice(text: str, where: str, choices: tuple[str, ...]) -> str:
    word = text.strip().lower()
    if word not in choices:
        raise UsageError(f"{where}: use one of {', '.join(choices)}")
    return word


def unquote_conf(text: str) -> str:
    """``text`` without one pair of matching quotes around all of it: a value passed with its
    quotes (``"--rdzv-conf='join_timeout=5,last_call_timeout=1'"`` in a Python argv list or a
    YAML launcher, where no shell removes them). torch keeps them, and then reads a key named
    ``'join_timeout`` and ignores it silently."""
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    return text


def split_rdzv_conf(text: str, where: str = "--rdzv-conf") -> list[tuple[str, str]]:
    """``k=v,k=v`` into (key, value) pairs exactly as torch's ``_parse_rendezvous_config``
    splits it (whitespace around keys and values dropped, the value after the first ``=``), once
    outer quotes are gone (:func:`unquote_conf`). Refused where torch refuses: an empty key or
    value, with elastictk's one line."""
    raw = unquote_conf(text).strip()
    if not raw:
        return []
    pairs = []
    for item in raw.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not key or not eq or not value:
            raise UsageError(f"{where}: {item.strip()!r} is not key=value; write k1=v1,k2=v2")
        pairs.append((key, value))
    return pairs


def parse_rdzv_conf(text: str, where: str = "--rdzv-conf") -> dict[str, float | bool]:
    """``k=v,k=v`` into typed values; unknown keys are refused with the list of known ones.

    torchrun's ``keep_alive_interval`` becomes ``heartbeat_interval`` and
    ``keep_alive_max_attempt=N`` becomes ``heartbeat_timeout = interval * N`` (a node is lost
    after N missed beats), so torchrun command lines keep their meaning.
    """
    conf: dict[str, float | bool] = {}
    seen: dict[str, str] = {}
    for key, value in split_rdzv_conf(text, where):
        kind = RDZV_CONF_KEYS.get(key)
        if kind is None:
            raise UsageError(
                f"{where}: unknown key {key!r}; known keys: {', '.join(RDZV_CONF_KEYS)}"
            )
        if key in seen:
            raise UsageError(f"{where}: {key} is given twice; give each key once")
        seen[key] = value
        at = f"{where}: {key}"
        if kind is bool:
            conf[key] = parse_bool(value, at)
        elif kind is int:
            conf[key] = parse_int(value, at, minimum=1)
        else:
            conf[key] = parse_seconds(value, at, allow_zero=key == "last_call_timeout")
    return _translate_keep_alive(conf, where)


def _translate_keep_alive(conf: dict[str, float | bool], where: str) -> dict[str, float | bool]:
    if "keep_alive_interval" in conf:
        if "heartbeat_interval" in conf:
            raise UsageError(f"{where}: give heartbeat_interval or keep_alive_interval, not both")
        conf["heartbeat_interval"] = conf.pop("keep_alive_interval")
    if "keep_alive_max_attempt" in conf:
        if "heartbeat_timeout" in conf:
            raise UsageError(
                f"{where}: give heartbeat_timeout or keep_alive_max_attempt, not both"
            )
        attempts = conf.pop("keep_alive_max_attempt")
        interval = float(conf.get("heartbeat_interval", TORCH_KEEP_ALIVE_INTERVAL))
        conf["heartbeat_timeout"] = interval * float(attempts)
    beat, lost = conf.get("heartbeat_interval"), conf.get("heartbeat_timeout")
    if beat is not None and lost is not None and float(lost) <= float(beat):
        raise UsageError(
            f"{where}: heartbeat_timeout={lost:g} must exceed heartbeat_interval={beat:g}"
        )
    return conf


_STD_FIX = "use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank like 0:1,1:2"


def parse_std(text: str, where: str) -> Std | dict[int, Std]:
    """torchrun's ``-r``/``-t`` forms: ``3`` for every worker, or ``0:1,1:2`` per local rank."""
    raw = text.strip()
    if re.fullmatch(r"[0-3]", raw):
        return Std(int(raw))
    if not re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", raw):
        raise UsageError(f"{where}: {_STD_FIX}")
    out: dict[int, Std] = {}
    for item in raw.split(","):
        rank, value = item.split(":")
        if int(rank) in out:
            raise UsageError(f"{where}: local rank {int(rank)} is given twice")
        out[int(rank)] = Std(int(value))
    return out


def expand_std(spec: Std | dict[int, Std], nproc: int) -> dict[int, Std]:
    """One entry per local rank, as torch's ``to_map`` does (ranks beyond ``nproc`` dropped)."""
    if isinstance(spec, Std):
        return {rank: spec for rank in range(nproc)}
    return {rank: spec.get(rank, Std.NONE) for rank in range(nproc)}


def parse_filters(text: str) -> tuple[str, ...]:
    """``apple,orange`` into the strings a duplicated line may hold (torchrun's
    ``--duplicate-*-filters``: ``,,`` is a literal comma). Empty text, or empty items, match
    nothing: an empty list duplicates no line, as torchrun's help says."""
    items = text.replace(",,", "\0").split(",")
    return tuple(item.replace("\0", ",") for item in items if item)


def parse_ranks(text: str, where: str = "--local-ranks-filter") -> frozenset[int] | None:
    """Comma-separated local ranks; empty means no filter (``None``)."""
    if not text.strip():
        return None
    ranks: set[int] = set()
    for item in text.split(","):
        try:
            rank = int(item.strip())
        except ValueError:
            rank = -1
        if rank < 0:
            raise UsageError(
                f"{where}: {item.strip()!r} is not a local rank; write ranks like 0,1,2"
            )
        ranks.add(rank)
    return frozenset(ranks)


def parse_signals(text: str, where: str = "--signals-to-handle") -> tuple[signal.Signals, ...]:
    """``SIGTERM,SIGINT`` (case-insensitive, ``SIG`` optional) into signal numbers."""
    out: list[signal.Signals] = []
    for item in text.split(","):
        name = item.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(
                f"{where}: {item.strip()!r} is not a signal name like SIGTERM"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"{where}: {name} cannot be caught; leave it out")
        if sig not in out:
            out.append(sig)
    return tuple(out)


def parse_intensity(text: str, where: str = "--restart-intensity") -> tuple[int, float]:
    """``R/T``: at most R restarts within any T seconds (Erlang/OTP's restart intensity)."""
    restarts, slash, period = text.partition("/")
    if not slash:
        raise UsageError(f"{where}: write R/T, e.g. 3/60 for at most 3 restarts in 60 seconds")
    return parse_int(restarts, f"{where}: R", minimum=0), parse_seconds(period, f"{where}: T")
