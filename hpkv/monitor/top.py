"""``hpkv-top``: a live full-screen monitor of the hpkv server of this pool directory.

It reads the server's stats segment and ring headers from the pool directory
(``HPKV_SHARE_MEM_FILE_PATH``); it never talks to the server, so it shows a busy
or stuck server as it is and cannot slow it down. With no server it says so and
waits; it follows a restarted server by itself.

Keys: ``q`` quits, space refreshes now. ``hpkv-top --once`` prints one frame as
plain text (for scripts and bug reports) and exits: 0 with a server, 1 without.
"""

from __future__ import annotations

import argparse
import locale
import shutil
import sys
import time
from typing import Any

from hpkv.config import ConfigError, load_config
from hpkv.monitor.frame import render, render_text
from hpkv.monitor.sample import View, Watcher


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpkv-top",
        description="Live monitor of the hpkv server of this machine's pool directory "
        "(HPKV_SHARE_MEM_FILE_PATH). Reads shared memory only. Keys: q quit, space refresh.",
    )
    p.add_argument(
        "-d",
        "--delay",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="refresh interval (default 1)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="print one frame as plain text and exit (rates are measured over one interval)",
    )
    p.add_argument(
        "--width",
        type=int,
        default=None,
        metavar="COLUMNS",
        help="frame width for --once (default: the terminal's, else 100)",
    )
    p.add_argument("--ascii", action="store_true", help="ASCII sparklines even on a UTF-8 terminal")
    return p


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds in [0.05, 3600]")
    return value


def _utf8(stream: Any) -> bool:
    enc = getattr(stream, "encoding", None) or locale.getpreferredencoding(False)
    return enc.lower().replace("-", "") == "utf8"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    try:
        cfg = load_config()
    except ConfigError as exc:
        print(f"hpkv-top: configuration error: {exc}", file=sys.stderr)
        return 1
    if args.once:
        return _once(cfg, args)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("hpkv-top: needs a terminal; use `hpkv-top --once` to print one frame", file=sys.stderr)
        return 2
    import curses

    locale.setlocale(locale.LC_ALL, "")
    return curses.wrapper(_run, cfg, args)


def _once(cfg, args) -> int:
    watcher = Watcher(cfg, args.delay)
    try:
        view = watcher.poll()
        if view.status == "up":
            time.sleep(args.delay)  # a second sample, so the rates are real
            view = watcher.poll()
    finally:
        watcher.close()
    width = args.width or (shutil.get_terminal_size((100, 40)).columns if sys.stdout.isatty() else 100)
    print(render_text(view, width, None, unicode=_utf8(sys.stdout) and not args.ascii))
    return 0 if view.status == "up" else 1


# ================================================================ curses
def _run(stdscr, cfg, args) -> int:
    import curses

    try:
        curses.curs_set(0)
    except curses.error:
        pass
    styles = _styles(curses)
    unicode = _utf8(sys.stdout) and not args.ascii
    watcher = Watcher(cfg, args.delay)
    view: View | None = None
    next_poll = 0.0
    dirty = True
    try:
        while True:
            now = time.monotonic()
            if now >= next_poll:
                view = watcher.poll()
                next_poll = now + args.delay
                dirty = True
            if dirty and view is not None:
                _draw(curses, stdscr, view, styles, unicode)
                dirty = False
            stdscr.timeout(max(1, int((next_poll - time.monotonic()) * 1000)))
            ch = stdscr.getch()
            if ch in (ord("q"), ord("Q")):
                return 0
            if ch == curses.KEY_RESIZE:
                curses.update_lines_cols()
                dirty = True
            elif ch == ord(" "):
                next_poll = 0.0
    finally:
        watcher.close()


def _styles(curses) -> dict[str, int]:
    styles = {
        "title": curses.A_REVERSE | curses.A_BOLD,
        "head": curses.A_BOLD,
        "text": curses.A_NORMAL,
        "warn": curses.A_BOLD,
        "dim": curses.A_DIM,
    }
    if curses.has_colors():
        try:
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_YELLOW, -1)
            curses.init_pair(2, curses.COLOR_CYAN, -1)
            styles["warn"] = curses.color_pair(1) | curses.A_BOLD
            styles["head"] = curses.color_pair(2) | curses.A_BOLD
        except curses.error:
            pass
    return styles


def _draw(curses, stdscr, view: View, styles: dict[str, int], unicode: bool) -> None:
    height, width = stdscr.getmaxyx()
    stdscr.erase()
    for y, (text, style) in enumerate(render(view, width, height, unicode)):
        # the bottom-right cell cannot be written without scrolling: stop one short there
        n = width - 1 if y == height - 1 else width
        try:
            stdscr.addnstr(y, 0, text, n, styles.get(style, 0))
        except curses.error:
            pass
    stdscr.noutrefresh()
    curses.doupdate()


if __name__ == "__main__":
    sys.exit(main())
