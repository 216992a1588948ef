"""The ``autoprec`` command line: one subcommand per job, each in its own ``_add_<name>`` function.

Conventions every subcommand keeps: ``--help``; bad input exits non-zero with one line on stderr
(``autoprec: error: ...``), never a traceback; progress on stderr for work longer than a few
seconds (a single rewritten line on a terminal, occasional lines otherwise); results on stdout;
machine-readable output written atomically. The logic lives in the library; this module only
parses, reports and writes; each subcommand's arguments and help text are spelled out here,
where ``--help`` reads them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from ._version import __version__
from .errors import AutoprecError, UserCodeError

__all__ = ["main"]

logger = logging.getLogger(__name__)

# Exit statuses: 0 done; 1 the command failed (or, with --check, a target failed); 2 bad usage;
# 130 interrupted (128 + SIGINT, the shell convention).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(Exception):
    """Raised instead of argparse's print-usage-and-exit, so `main` can report one line and return."""


class _Parser(argparse.ArgumentParser):
    # Subparsers are created with the parent's class, so every level reports errors this way.
    def error(self, message: str):
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _one_line(text: str) -> str:
    """Multi-line error messages (a `PlanError` lists its problems) joined onto one line."""
    parts = [part.strip(" -") for part in str(text).splitlines() if part.strip()]
    joined = ""
    for part in parts:
        joined += part if not joined else (" " if joined.endswith(":") else "; ") + part
    return joined


def _fail(message: str, status: int) -> int:
    print(f"autoprec: error: {_one_line(message)}", file=sys.stderr)
    return status


def _debugging(args: argparse.Namespace) -> bool:
    """``--debug``, or ``AUTOPREC_DEBUG`` set to anything but 0 / empty (read now, not at import)."""
    return bool(getattr(args, "debug", False)) or os.environ.get("AUTOPREC_DEBUG", "0") not in ("", "0")


def _library_dirs() -> tuple[str, ...]:
    """Where autoprec, torch and the standard library live: frames there are not the user's."""
    import sysconfig

    import torch

    dirs = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__))]
    dirs += [sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")]
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


def _user_frames(exc: BaseException) -> str:
    """The frames of ``exc``'s traceback in the user's own files, formatted as Python does."""
    skip = _library_dirs()
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not os.path.abspath(f.filename).startswith(skip) and not f.filename.startswith("<")]
    return "".join(traceback.format_list(frames))


def _report(exc: AutoprecError, debug: bool) -> int:
    """One ``autoprec: error:`` line; for the user's own code failing, its frames after it (all
    frames, autoprec's too, before it with ``debug``)."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    status = _fail(str(exc), EXIT_FAILED)
    if isinstance(exc, UserCodeError) and exc.__cause__ is not None and not debug:
        frames = _user_frames(exc.__cause__)
        if frames:
            print(f"your code, innermost call last:\n{frames.rstrip()}", file=sys.stderr)
        print("(run with --debug or AUTOPREC_DEBUG=1 for the full traceback)", file=sys.stderr)
    return status


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _shape3(text: str) -> tuple[int, int, int]:
    parts = text.replace("x", ",").split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected three positive integers BATCH,SEQ,D_MODEL, got {text!r}")
    return values


def _output_path(text: str) -> Path:
    """A file path whose directory exists, checked before any work starts."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} does not exist")
    return path


class _CtrlC:
    """Ctrl-C that a command never loses.

    Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT lands. In
    a finalizer or a weakref callback (SQLAlchemy runs some during a search) it is printed as
    "Exception ignored" with a traceback and dropped, and the command would carry on to the end.
    So the handler also latches the interrupt, `check` (called on every progress tick and when a
    command's work returns) raises it again, and the dropped one is not printed (the user sees
    the command's one-line "interrupted" message, not a traceback from a library's callback).
    """

    def __init__(self):
        self.seen = False
        self._previous = None
        self._previous_unraisable = None

    def __enter__(self) -> "_CtrlC":
        self.seen = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._previous_unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _handle(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        if self.seen and unraisable.exc_type is KeyboardInterrupt:
            return  # latched: `check` raises it again
        self._previous_unraisable(unraisable)

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed during this command."""
        if self.seen:
            raise KeyboardInterrupt

    def caused(self, exc: Optional[BaseException]) -> bool:
        """Whether ``exc`` is this command's Ctrl-C: the KeyboardInterrupt itself, or an error a
        library raised while the interrupt unwound through it (Optuna's trial bookkeeping raised
        UnboundLocalError when Ctrl-C landed inside it), found in the ``__context__`` chain; or
        any error once Ctrl-C was latched (a storage commit it cut short failed on the next
        write, its KeyboardInterrupt dropped by SQLAlchemy: "the study's storage failed" and exit
        1 where the user pressed Ctrl-C)."""
        if self.seen:
            return True
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, KeyboardInterrupt):
                return True
            seen.add(id(exc))
            exc = exc.__context__
        return False

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            sys.unraisablehook = self._previous_unraisable
            self._previous = self._previous_unraisable = None


_CTRL_C = _CtrlC()


class _Progress:
    """Progress of a long command on stderr: on a terminal a ``tqdm`` bar (one line, redrawn);
    otherwise a plain line at most every ``every_s`` seconds and at phase changes, since a log
    file would keep every redraw of a bar. Each tick also stops the command after Ctrl-C."""

    def __init__(self, label: str, stream=None, every_s: float = 15.0):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.start = self.last = time.monotonic()
        self.phase: Optional[str] = None
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar: Optional[tqdm] = None  # made at the first tick, which knows the total

    def __call__(self, done: int, total: int, phase: str) -> None:
        _CTRL_C.check()
        if self.tty:
            desc = f"[{self.label}] {phase} round"
            if self.bar is None:
                self.bar = tqdm(total=total, desc=desc, file=self.stream, leave=False, mininterval=0, bar_format="{desc} {n}/{total} ({elapsed})")
            self.bar.set_description_str(desc, refresh=False)
            self.bar.total, self.bar.n = total, done
            self.bar.refresh()
        else:
            now = time.monotonic()
            if phase != self.phase or now - self.last >= self.every_s or done == total:
                print(f"[{self.label}] {phase} round {done}/{total} ({now - self.start:.0f} s)", file=self.stream, flush=True)
                self.last = now
        self.phase = phase

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _logging_to_stderr(verbose: bool):
    """Show autoprec's log records on stderr for this command only (WARNING, or INFO with -v)."""
    root = logging.getLogger("autoprec")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = root.level, root.propagate
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]


# -- workloads --------------------------------------------------------------------------------


def _add_workload_args(p: argparse.ArgumentParser, what: str) -> None:
    from .workloads import LMConfig

    p.add_argument(
        "--workload", default="small", metavar="PRESET|MODULE:FUNCTION",
        help=f"{what}: a built-in LM preset ({', '.join(LMConfig.preset_names())}; default small) or "
             "module:function returning an autoprec.workload.Workload (as a search job's [workload].factory)",
    )
    p.add_argument("--workload-kwargs", default=None, metavar="JSON", help='keyword arguments of MODULE:FUNCTION as a JSON object, e.g. \'{"batch_size": 8}\'')
    p.add_argument("--batch-size", type=_positive_int, default=None, help="the built-in LM's batch size (default 16)")


def _workload_from_args(args: argparse.Namespace, lr: "float | None" = None):
    """The workload ``--workload`` names; `WorkloadError` (one line, naming the option) otherwise."""
    import dataclasses
    import json

    from .workload import WorkloadError, load_workload
    from .workloads import LMConfig, default_workload

    if ":" in args.workload:
        if args.batch_size is not None:
            raise WorkloadError("argument --batch-size: applies to the built-in presets only; pass it in --workload-kwargs")
        try:
            kwargs = json.loads(args.workload_kwargs) if args.workload_kwargs else {}
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"argument --workload-kwargs: not JSON ({exc.msg}); give an object such as '{{\"batch_size\": 8}}'") from None
        if not isinstance(kwargs, dict):
            raise WorkloadError("argument --workload-kwargs: give a JSON object of keyword arguments")
        try:
            return load_workload(args.workload, kwargs, search_dirs=(Path.cwd(),))
        except WorkloadError as exc:
            raise WorkloadError(f"argument --workload: {exc}") from None
    if args.workload_kwargs is not None:
        raise WorkloadError("argument --workload-kwargs: applies to --workload MODULE:FUNCTION only")
    if args.workload not in LMConfig.preset_names():
        raise WorkloadError(f"argument --workload: unknown preset {args.workload!r}; choose one of {', '.join(LMConfig.preset_names())} or give module:function")
    workload = default_workload(args.workload, batch_size=args.batch_size or 16)
    return workload if lr is None else dataclasses.replace(workload, lr=lr)


# -- bench ------------------------------------------------------------------------------------


def _add_bench(subparsers, common: argparse.ArgumentParser) -> None:
    from .bench import DEFAULT_VARIANTS, BenchConfig
    from .workloads import BlockWorkload

    default = BenchConfig()
    default_block = BlockWorkload()
    p = subparsers.add_parser(
        "bench",
        parents=[common],
        help="benchmark every precision variant on a workload and one transformer block",
        description=(
            "Train a workload (the built-in byte-level LM, or --workload module:function) and one "
            "TransformerBlock under each variant (plain "
            "fp32, uniform autoprec plans, plain torch.autocast), interleaved round-robin, and "
            "report the median step time and the bytes saved for backward, each as a ratio to "
            "fp32, plus the INT8 calibration error and which layers ran emulated. Prints a table "
            "on stdout."
        ),
    )
    p.add_argument("--steps", type=_positive_int, default=None, help=f"timed rounds (default {default.steps}; --quick: 3)")
    p.add_argument("--warmup", type=_positive_int, default=None, help=f"untimed rounds first (default {default.warmup}; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="1 warmup + 3 timed rounds: a smoke run, too short for trustworthy timings")
    p.add_argument("--device", default=default.device, help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N (default auto)")
    _add_workload_args(p, "the first target")
    p.add_argument(
        "--block-shape", type=_shape3, default=default_block.shape, metavar="B,T,C",
        help="the second target, one TransformerBlock: its input shape batch,seq,d_model (default %s)" % ",".join(map(str, default_block.shape)),
    )
    p.add_argument(
        "--variants", default=None, metavar="V1,V2,...",
        help="comma-separated: fp32 (required, the reference), plan:<format>, autocast:<bf16|fp16> "
             f"(default {','.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument("--seed", type=int, default=default.seed, help="seed of the models and batches (default 0)")
    p.add_argument("--json", type=_output_path, default=None, metavar="PATH", help="also write the full result as JSON (atomically)")
    p.add_argument("--check", action="store_true", help="exit 1 when a target fails (targets are otherwise only reported)")
    p.add_argument(
        "--suite", choices=("models", "ops", "gpu"), default="models",
        help="models: the variants above on the built-in LM and block (default); ops: aten ops and "
             "host syncs per step of one Linear under every variant, graph breaks and torch.compile "
             "vs eager of an MLP (takes --warmup, --device, --seed and --json only); gpu: the GPU "
             "suite (correctness probe, per-layer and end-to-end speed; see benchmarks/README.md), "
             "which uses only --device, --json, --check, --smoke and --plan",
    )
    p.add_argument("--smoke", action="store_true", help="--suite gpu: every code path at tiny sizes, for a CPU; timings mean nothing")
    p.add_argument(
        "--plan", type=Path, default=None, metavar="PLAN.json",
        help="--suite gpu: the searched plan to train end to end (default: per layer the faster of "
             "bf16 and fp8 in the per-layer timings)",
    )
    p.set_defaults(handler=_cmd_bench)


def _cmd_bench_gpu(args: argparse.Namespace) -> int:
    from .bench.gpu import GpuBenchConfig, GpuBenchError, run_gpu_bench

    progress = _Progress("bench gpu")
    try:
        result = run_gpu_bench(GpuBenchConfig.from_preset("smoke" if args.smoke else "full"), args.device, args.plan, progress)
    except GpuBenchError as exc:
        return _fail(f"{exc} (see 'autoprec bench --help')", EXIT_USAGE)
    finally:
        progress.close()
    status = _write_json(result, args.json)
    if status != EXIT_OK:
        return status
    # Last, so the end of a long log (all some machines return) shows it.
    print(result.format_table(), flush=True)
    if args.check and not result.passed:
        return _fail("a check or target failed (see the table and the JSON)", EXIT_FAILED)
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, BenchConfigError, run_bench

    if args.suite == "gpu":
        return _cmd_bench_gpu(args)
    if args.suite == "ops":
        return _cmd_bench_ops(args)
    if args.smoke or args.plan is not None:
        return _fail("options --smoke and --plan belong to --suite gpu (see 'autoprec bench --help')", EXIT_USAGE)

    from .workload import WorkloadError
    from .workloads import BlockWorkload

    try:
        targets = {"workload": _workload_from_args(args), "block": BlockWorkload(args.block_shape)}
    except (WorkloadError, ValueError) as exc:
        return _fail(f"{exc} (see 'autoprec bench --help')", EXIT_USAGE)
    overrides = {"device": args.device, "seed": args.seed}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.warmup is not None:
        overrides["warmup"] = args.warmup
    if args.variants is not None:
        overrides["variants"] = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    try:
        config = BenchConfig.from_preset("quick" if args.quick else "default", **overrides)
    except BenchConfigError as exc:
        return _fail(f"{exc} (see 'autoprec bench --help')", EXIT_USAGE)
    result = _run_and_print("bench", lambda config, progress: run_bench(targets, config, progress), config)
    status = _write_json(result, args.json)
    if status != EXIT_OK:
        return status
    if args.check and not result.passed:
        failed = ", ".join(t.name for t in result.targets if not t.passed)
        return _fail(f"targets failed: {failed}", EXIT_FAILED)
    return EXIT_OK


def _run_and_print(label: str, run: Callable, config):
    """``run(config, progress=...)`` with progress on stderr, its table on stdout; the result."""
    progress = _Progress(label)
    try:
        result = run(config, progress=progress)
    finally:
        progress.close()
    print(result.format_table())
    return result


def _write_json(result, path: Optional[Path]) -> int:
    """``result.save(path)`` when a path was given; a failed write is one line and exit 1."""
    if path is None:
        return EXIT_OK
    try:
        result.save(path)
    except OSError as exc:
        return _fail(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED)
    print(f"wrote {path}", file=sys.stderr)
    return EXIT_OK


def _cmd_bench_ops(args: argparse.Namespace) -> int:
    from .bench import BenchConfigError, OpsBenchConfig, run_ops_bench

    models_only = [flag for flag, given in (("--steps", args.steps), ("--variants", args.variants), ("--quick", args.quick), ("--check", args.check)) if given]
    if models_only:
        return _fail(f"the ops suite takes only --warmup, --device, --seed and --json; drop {', '.join(models_only)} (see 'autoprec bench --help')", EXIT_USAGE)
    overrides = {"device": args.device, "seed": args.seed}
    if args.warmup is not None:
        overrides["warmup"] = args.warmup
    try:
        config = OpsBenchConfig(**overrides)
    except BenchConfigError as exc:
        return _fail(f"{exc} (see 'autoprec bench --help')", EXIT_USAGE)
    return _write_json(_run_and_print("bench ops", run_ops_bench, config), args.json)


# -- profile ----------------------------------------------------------------------------------


def _add_profile(subparsers, common: argparse.ArgumentParser) -> None:
    from .formats import Format

    p = subparsers.add_parser(
        "profile",
        parents=[common],
        help="profile per-layer statistics over a window of real training steps",
        description=(
            "Train a workload (the built-in byte-level LM, or --workload module:function) for --steps "
            "steps, with its own optimizer, and a LayerProfiler attached, and "
            "write the Profile (per-layer gradient mean / variance / noise-to-signal ratio, amax "
            "histories, histograms, underflow / overflow fractions per candidate format, non-finite "
            "counts) as JSON, plus TensorBoard histograms with --logdir. Prints one line per layer."
        ),
    )
    _add_workload_args(p, "what to train")
    p.add_argument("--steps", type=_positive_int, default=100, help="training steps to profile: the window (default 100)")
    p.add_argument("--out", type=_output_path, default=Path("profile.json"), metavar="PATH", help="profile JSON to write, atomically (default profile.json)")
    p.add_argument("--logdir", default=None, metavar="DIR", help="also write TensorBoard events (histograms, amax) under DIR")
    p.add_argument(
        "--formats", default=None, metavar="F1,F2,...",
        help=f"candidate formats for the underflow / overflow fractions (default all: {','.join(f.value for f in Format)})",
    )
    p.add_argument("--sample", type=_positive_int, default=8192, help="elements histogrammed per tensor per call (default 8192)")
    p.add_argument("--every", type=_positive_int, default=8, help="histogram each layer every N-th step; amax every step (default 8)")
    p.add_argument("--lr", type=float, default=None, help="the built-in LM's peak AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and batches (default 0)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N (default auto)")
    p.set_defaults(handler=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    from .errors import FormatError, ProfileError
    from .formats import Format
    from .monitoring.profile import write_tensorboard
    from .profiling import profile_workload
    from .workload import WorkloadError

    usage = "(see 'autoprec profile --help')"
    formats = tuple(Format)
    if args.formats is not None:
        try:
            formats = tuple(Format.parse(f) for f in args.formats.split(",") if f.strip())
        except FormatError as exc:
            return _fail(f"argument --formats: {exc} {usage}", EXIT_USAGE)
        if not formats:
            return _fail(f"argument --formats: give at least one format {usage}", EXIT_USAGE)
    if args.lr is not None and (not args.lr > 0 or args.lr == float("inf")):
        return _fail(f"argument --lr: expected a positive number, got {args.lr} {usage}", EXIT_USAGE)
    if args.lr is not None and ":" in args.workload:
        return _fail(f"argument --lr: applies to the built-in presets only; a MODULE:FUNCTION workload sets its own optimizer {usage}", EXIT_USAGE)
    try:
        workload = _workload_from_args(args, lr=args.lr)
    except WorkloadError as exc:
        return _fail(f"{exc} {usage}", EXIT_USAGE)
    logdir = Path(args.logdir) if args.logdir is not None else None
    if logdir is not None and logdir.exists() and not logdir.is_dir():
        return _fail(f"argument --logdir: {str(logdir)!r} is a file; give a directory {usage}", EXIT_USAGE)
    progress = _Progress("profile")
    try:
        profile = profile_workload(
            workload, args.steps, seed=args.seed, device=args.device, formats=formats, sample=args.sample,
            every=args.every, progress=progress, metadata={"workload": args.workload, "batch_size": getattr(workload, "batch_size", None)},
        )
    except ProfileError as exc:
        return _fail(f"{exc} {usage}", EXIT_USAGE)
    finally:
        progress.close()
    print(profile.format_table())
    try:
        profile.save(args.out)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc.strerror or exc}", EXIT_FAILED)
    print(f"wrote {args.out}", file=sys.stderr)
    if logdir is not None:
        try:
            write_tensorboard(profile, logdir)
        except OSError as exc:
            return _fail(f"cannot write TensorBoard events under {logdir}: {exc.strerror or exc}", EXIT_FAILED)
        print(f"wrote TensorBoard events under {logdir}", file=sys.stderr)
    return EXIT_OK


# -- search -----------------------------------------------------------------------------------


def _add_search(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "search",
        parents=[common],
        help="search per-layer formats under memory and accuracy budgets (an offline job)",
        description=(
            "Run the search job CONFIG.toml (see searches/README.md): train and profile the "
            "workload's model, cost every (layer, format) on this device, predict each one's loss "
            "increase, find the [search].measure_top best plans of the additive proxy exactly "
            "(an integer program), then measure them for real in an Optuna study. Writes plan.json (only when a plan "
            "met the budgets as measured), profile.json, the Optuna study and TensorBoard logs "
            "under [job].out; prints the measured candidates against FP32 and BF16 autocast. "
            "Exit status 0 only when a plan met the budgets. An interrupted job resumes its study."
        ),
    )
    p.add_argument("config", type=Path, metavar="CONFIG.toml", help="the search job file")
    p.add_argument(
        "--workers", type=_positive_int, default=1, metavar="N",
        help="measure the candidates in N processes on one study (default 1); N > 1 needs [search].storage to be a "
             "journal file (study.journal) or a PostgreSQL URL. Another machine joins by running the same job "
             "file with the same PostgreSQL storage",
    )
    p.set_defaults(handler=_cmd_search)


def _cmd_search(args: argparse.Namespace) -> int:
    import optuna

    from .job.config import load_job
    from .job.run import run_job

    config = load_job(args.config)
    optuna.logging.set_verbosity(optuna.logging.INFO if args.verbose else optuna.logging.WARNING)
    progress = _Progress(f"search {config.name}")
    try:
        result = run_job(config, progress=progress, workers=args.workers)
        _CTRL_C.check()
    except BaseException as exc:
        if not _CTRL_C.caused(exc):
            raise
        progress.close()
        print(f"autoprec: search interrupted; run the same command again to resume from the study in {config.storage_url}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        progress.close()
    print(result.format_table())
    print(f"wrote the study, profile and TensorBoard logs under {config.out}", file=sys.stderr)
    if not result.met_budgets:
        return _fail("no candidate plan met the budgets as measured; loosen [budgets] or raise [search].measure_top", EXIT_FAILED)
    return EXIT_OK


# -- review -----------------------------------------------------------------------------------


def _add_review(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "review",
        parents=[common],
        help="write plans and their layer-by-layer differences for TensorBoard",
        description=(
            "Write each PLAN.json (precision map image, layer table with reasons, totals against "
            "FP32 and the budgets, an HParams session) and the differences between consecutive "
            "plans to --logdir for TensorBoard, and print the differences as a table."
        ),
    )
    p.add_argument("plans", nargs="+", metavar="PLAN.json", type=Path, help="plan files, compared in the order given")
    p.add_argument("--logdir", type=Path, default=Path("runs/review"), help="TensorBoard log folder (default runs/review)")
    p.add_argument("--open", action="store_true", help="start tensorboard --logdir DIR on 127.0.0.1, print its address, run until Ctrl-C")
    p.set_defaults(handler=_cmd_review)


def _cmd_review(args: argparse.Namespace) -> int:
    from .monitoring import load_plans, start_tensorboard, write_review

    result = write_review(load_plans(args.plans), args.logdir)
    print(result.format_table())
    print(f"wrote TensorBoard events under {args.logdir}", file=sys.stderr)
    if args.open:
        with start_tensorboard(args.logdir) as server:
            print(f"TensorBoard at {server.url} (Ctrl-C to stop)", flush=True)
            server.wait()
    return EXIT_OK


# -- export -----------------------------------------------------------------------------------


def _add_export(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "export",
        parents=[common],
        help="write a plan for another library to run (torchao, torchtitan, Transformer Engine)",
        description=(
            "Write PLAN.json as a self-contained Python module: for torchao's float8 training, the "
            "nn.Linear layers to convert per recipe (a module_filter_fn over fully-qualified names, "
            "and convert(model)); for torchtitan 0.3.0, converters() for a job's model_spec (one "
            "Float8LinearConverter per recipe, its filter_fqns); for Transformer Engine 2.20, a "
            "CustomRecipe whose qfactory gives each te.Linear and tensor role the plan's quantizer. "
            "Every layer that stays in high precision is listed with the reason."
        ),
    )
    p.add_argument("plan", type=Path, metavar="PLAN.json", help="the plan to export")
    p.add_argument("--to", required=True, choices=("torchao", "torchtitan", "transformer-engine"), help="the target library")
    p.add_argument("--out", type=_output_path, default=None, metavar="PATH.py", help="where to write (default: <plan>_<target>.py beside the plan)")
    p.set_defaults(handler=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from .integrations.export import write_torchao
    from .integrations.export_te import write_transformer_engine
    from .integrations.export_torchtitan import write_torchtitan

    writers: dict[str, Callable] = {"torchao": write_torchao, "torchtitan": write_torchtitan, "transformer-engine": write_transformer_engine}
    try:
        out, export = writers[args.to](args.plan, args.out)
    except OSError as exc:
        return _fail(f"cannot read {args.plan} or write the export: {exc.strerror or exc}", EXIT_FAILED)
    for line in (*export.summary(), f"wrote {out}"):
        print(line, file=sys.stderr)
    return EXIT_OK


# -- entry point ------------------------------------------------------------------------------

# Each subcommand registers itself here, one function each.
_COMMANDS: tuple[Callable, ...] = (_add_bench, _add_profile, _add_search, _add_review, _add_export)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autoprec",
        description="Per-layer training precision for PyTorch: measure, search, apply.",
    )
    parser.add_argument("--version", action="version", version=f"autoprec {__version__}")
    common = _Parser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log progress details (INFO) on stderr")
    common.add_argument("--debug", action="store_true", help="on an error, print the full traceback (also AUTOPREC_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    subparsers.required = True
    for add in _COMMANDS:
        add(subparsers, common)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (``--help`` / ``--version`` raise SystemExit(0))."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    with _logging_to_stderr(getattr(args, "verbose", False)), _CTRL_C:
        try:
            return args.handler(args)
        except AutoprecError as exc:
            return _report(exc, _debugging(args))
        except BaseException as exc:
            if not _CTRL_C.caused(exc):
                raise
            print("autoprec: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
