"""What every script in scripts/ shares: one argparse flavour and one error policy.

A user's mistake ends a script with one line on stderr: a `DsattnError` (bad config value,
mismatched checkpoint, exhausted cache, ...) or a missing file exits with status 1, a bad
argument with status 2. Anything else is a bug and keeps its traceback. A warning is one
line too (`script.py: warning: message`), not Python's file, line number and source line.
`--debug` (or DSATTN_DEBUG=1) keeps the traceback for user errors too, Python's form of
warnings, and orbax's logged tracebacks.

    def main(argv=None):
        ap = cli.parser(__doc__, overrides=True)
        ...
        args = cli.parse(ap, argv)        # args.overrides: every KEY=VALUE, wherever it was

    if __name__ == "__main__":
        cli.run(main)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import warnings

from dsattn.errors import DsattnError

# Missing or unreadable files are the user's to fix; other OSErrors may be bugs.
USER_ERRORS = (DsattnError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError)
OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.\w+)?=.*", re.S)  # section.key=value (or name=...)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser(doc: str | None, *, overrides: bool = False) -> Parser:
    """A parser with --debug and, if asked, KEY=VALUE config overrides. Add the script's own
    positionals before calling `parse` (overrides are collected from anywhere)."""
    epilog = ("KEY=VALUE config overrides (section.key=value, e.g. train.steps=100) may stand "
              "anywhere on the command line." if overrides else None)
    ap = Parser(description=doc, epilog=epilog, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true",
                    help="show the full traceback of an error (also DSATTN_DEBUG=1)")
    ap.set_defaults(overrides=[])
    ap._dsattn_overrides = overrides
    return ap


def parse(ap: Parser, argv=None) -> argparse.Namespace:
    """Parse argv; with overrides, every KEY=VALUE that is not an option's value (before or
    after options, before or after positionals) goes to args.overrides in order."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = []
    if getattr(ap, "_dsattn_overrides", False):
        rest, takes_value = [], False
        for tok in argv:
            if not takes_value and OVERRIDE.fullmatch(tok) and not os.path.exists(tok):
                overrides.append(tok)
            else:
                rest.append(tok)
            action = ap._option_string_actions.get(tok) if tok.startswith("-") else None
            takes_value = action is not None and action.nargs != 0
        argv = rest
    args = ap.parse_args(argv)
    args.overrides = overrides
    return args


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return n


def nonnegative_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return n


def progress_option(ap: Parser, unit: str = "steps", default: str | None = None) -> None:
    """--progress-every N (dsattn.progress): the plain progress lines' interval off a
    terminal."""
    ap.add_argument("--progress-every", type=positive_int, default=None, metavar="N",
                    help=f"off a terminal (a log file, CI, a pipe): a progress line every N "
                         f"{unit} (default: {default or 'a tenth of them, at most 50 apart'}); "
                         f"on a terminal a progress bar")


def int_list(text: str) -> list[int]:
    """'128,512' -> [128, 512] (each >= 1)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return out


def run(main, argv=None):
    """Run main(argv) under the error policy and exit with its status."""
    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args or os.environ.get("DSATTN_DEBUG", "") not in ("", "0")
    prog = os.path.basename(sys.argv[0]) or "dsattn"
    if not debug:  # orbax's threads and event loops log a failed write (a full disk) with
        # pages of traceback, once per array, before the error reaches main(): its one line
        # below says it all
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_without_traceback)  # once, however many runs
        sys.unraisablehook = _unraisable
    shown = warnings.showwarning
    if not debug:
        warnings.showwarning = _warning_line(prog)
    try:
        status = main(args)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        warnings.showwarning = shown  # run() may be called in-process (tests)
    sys.exit(status if isinstance(status, int) else 0)


def _warning_line(prog: str):
    """warnings.showwarning that prints a warning as a message: one line, no source."""
    def show(message, category, filename, lineno, file=None, line=None):
        try:
            print(f"{prog}: warning: {_one_line(message)}", file=file or sys.stderr, flush=True)
        except OSError:  # stderr gone (a closed pipe): as Python's own hook, say nothing
            pass
    return show


def _without_traceback(record: logging.LogRecord) -> bool:
    return record.exc_info is None


def _unraisable(u) -> None:
    """After a failed checkpoint write (a full disk), tensorstore's callbacks for the writes
    still in flight find orbax's event loop closed: not news, the error says it all."""
    if not (u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed"):
        sys.__unraisablehook__(u)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text += f": {e.filename}"
    return text


def load_run(run_dir, step: int | None = None, overrides=()):
    """(model, cfg, step) of a run directory: its config.yaml (plus overrides; the model's own
    sections must not change) and the latest or the given checkpoint step."""
    from pathlib import Path

    from dsattn import checkpoint

    run_dir = Path(run_dir)
    cfg = checkpoint.load_run_config(run_dir, overrides)
    if step is not None:
        saved = checkpoint.manager(run_dir, keep=1_000_000).all_steps()
        if step not in saved:
            raise FileNotFoundError(f"{run_dir}: no checkpoint at step {step}; saved steps: "
                                    f"{', '.join(map(str, sorted(saved))) or 'none'}")
    return checkpoint.load_params(run_dir, cfg, step)
