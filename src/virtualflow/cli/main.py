"""``virtualflow`` command line: one module per verb."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from virtualflow.cli import cluster, explain, export, gnn, plan, plot, resize, run, simulate, simulate_spot, status, worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="virtualflow",
        description="Train the same model on any hardware: a fixed global batch split into virtual nodes.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parser(sub)
    status.add_parser(sub)
    resize.add_parser(sub)
    plot.add_parser(sub)
    export.add_parser(sub)
    plan.add_parser(sub)
    explain.add_parser(sub)
    simulate.add_parser(sub)
    simulate_spot.add_parser(sub)
    gnn.add_parser(sub)
    worker.add_parser(sub)
    cluster.add_parser(sub)  # cluster start|status|stop|dashboard|replay, submit, queue, cancel
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
