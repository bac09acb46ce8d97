"""``virtualflow`` command line: one module per verb."""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
import traceback

# The verbs in the order ``virtualflow --help`` lists them: (verb, module, one-line help). Only the
# verb being run has its module imported (they pull in torch and most of the library); the others
# are listed with this help line. tests/unit/test_cli_console.py checks it against the modules.
VERBS: tuple[tuple[str, str, str], ...] = (
    ("run", "run", "train a job"),
    ("status", "status", "show a run's progress and workers"),
    ("resize", "resize", "change a running job's number of workers"),
    ("plot", "plot", "plot loss and evaluation curves of runs"),
    ("export", "export", "write a run's model as one .safetensors or .pt file"),
    ("plan", "plan",
     "profile a pipelined job's layers and predict its split, step time, bubble and memory"),
    ("explain", "explain",
     "print a communication program (CoCoNeT) and its rewritten form with layouts and bytes per rank"),
    ("simulate", "simulate", "simulate a cluster scheduling policy on a job trace"),
    ("simulate-spot", "simulate_spot",
     "replay a spot-availability trace: Bamboo redundancy vs checkpoint-restart vs on-demand"),
    ("gnn", "gnn",
     "train a GNN Dorylus-style: graph servers, tensor workers, bounded staleness; cost and value"),
    ("worker", "worker", "join a job started with --backend external"),
    ("cluster", "cluster",
     "run the cluster service: a scheduler that places, resizes and preempts jobs"),
    ("submit", "cluster", "queue a job on a cluster service"),
    ("queue", "cluster", "the jobs of a cluster: state, placement, progress, JCT"),
    ("cancel", "cluster", "cancel a queued or running job"),
)


class Parser(argparse.ArgumentParser):
    """No abbreviations (``--step`` is not silently ``--steps``); subparsers inherit the class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The whole parser (``verb=None``), or one whose ``verb`` is complete and whose other verbs
    are stubs that only carry their help line (what :func:`main` builds: one verb's module loads)."""
    parser = Parser(
        prog="virtualflow",
        description="Train the same model on any hardware: a fixed global batch split into virtual nodes.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    loaded: set[str] = set()
    for name, module, help_line in VERBS:
        if verb is None or module == _module_of(verb):
            if module not in loaded:  # one module may add several verbs (cluster, submit, queue, cancel)
                loaded.add(module)
                importlib.import_module(f"virtualflow.cli.{module}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def _module_of(verb: str) -> str | None:
    return next((module for name, module, _ in VERBS if name == verb), None)


def _verb(argv: list[str]) -> str | None:
    """The verb ``argv`` names: its first word that is not an option (the top level has only flags)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser the command line reached: ``cluster start --dri x`` -> ``cluster start``'s."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and word in subs[0].choices:
            parser = subs[0].choices[word]
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown flag is reported by the verb it was given to,
    with its usage and the closest flags it has (``did you mean --steps?``); exit code 2."""
    verb = _verb(argv)
    if verb is not None and _module_of(verb) is None:
        close = difflib.get_close_matches(verb, [name for name, _, _ in VERBS], n=1)
        parser.error(f"unknown command {verb!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                     + f" (commands: {', '.join(name for name, _, _ in VERBS)})")
    args, extras = parser.parse_known_args(argv)
    if extras:
        inner = _innermost(parser, argv)
        hints = []
        for word in extras:
            if word.startswith("-"):
                flag = word.split("=", 1)[0]
                close = difflib.get_close_matches(flag, list(inner._option_string_actions), n=1, cutoff=0.7)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
        message = f"unrecognized arguments: {' '.join(extras)}"
        inner.error(message + ("; " + "; ".join(hints) if hints else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_verb(argv) if _module_of(_verb(argv) or "") else "")
    args = parse(parser, argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[ConsoleHandler(sys.stderr)])
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        # User errors: one clear line (the traceback with --verbose), exit code 2.
        if args.verbose:
            traceback.print_exc()
        print(f"virtualflow {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a runtime failure: one line, exit code 1
        if args.verbose:
            traceback.print_exc()
        print(f"virtualflow {args.command}: failed: {type(exc).__name__}: {_one_line(exc)} (--verbose shows the "
              f"traceback)", file=sys.stderr)
        return 1


class ConsoleHandler(logging.StreamHandler):
    """The console's log lines, written through the progress bar: a line goes above a live bar
    (``tqdm.write`` clears it, writes, redraws it) instead of being glued onto its end. tqdm is
    imported at the first line logged, so a verb that logs nothing does not load it."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm  # the class the run's progress bar is made of (launching/supervisor.py)
        except ImportError:  # no tqdm, no bar: a plain line
            super().emit(record)
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must not raise (the logging module's own rule)
            self.handleError(record)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
