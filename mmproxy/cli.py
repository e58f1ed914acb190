"""Command line: ``mmproxy demo``, ``mmproxy bench``, ``mmproxy make-shards``.

An interrupt (Ctrl-C) ends the command with one line, ``mmproxy COMMAND: interrupted``, and exit
code 130: the first raises ``KeyboardInterrupt``, and the command cleans up on its way out (its
servers and workers stop, half-written files go); one more while it does exits at once. An
interrupt that lands in a callback that cannot raise (a fork's hooks, a callback from C) is
raised again once the callback is over (:class:`_Interrupts`); a command still running
:data:`GRACE` seconds after its first interrupt (swallowed without a trace) ends the process.
docs/internals.md, ``mmproxy.cli``, has the rest.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any

from mmproxy._commands import build_parser, unrecognized
from mmproxy.errors import install_hint

__all__ = ["main"]

# (command, option) -> the package it needs, checked before the command runs
_NEEDS = {("bench", "plot"): "matplotlib", ("demo", "video"): "av"}


def _one_line(err: BaseException) -> str:
    """The error's message on one line; a skip limit's summary follows on lines of its own."""
    from mmproxy.errors import EmptyEpochError, SkipLimitError

    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    caught = re.match(r"Caught (\w+) in DataLoader (worker process \d+)", lines[0]) if lines else None
    if caught and "Traceback (most recent call last)" in text:
        # torch re-raises a worker's error with its traceback in the message: keep the error's
        # own line(s), its type without its module, and say which worker
        name, where = caught[1], caught[2]
        own = re.compile(rf"^(?:[\w.]+\.)?{name}(?=: |$)")
        at = max((i for i, line in enumerate(lines) if own.match(line)), default=len(lines) - 1)
        message = " ".join([own.sub(name, lines[at]), *lines[at + 1:]])
        return f"{message} (in DataLoader {where})"
    if isinstance(err, SkipLimitError):  # worded with the option that sets the limit
        head = (f"{err.counted}, more than --max-skipped={err.limit:.1%} "
                "(raise --max-skipped to accept it):")
        return "\n".join([head, *("  " + line for line in err.summary.splitlines() if line)])
    if isinstance(err, EmptyEpochError) and len(lines) > 1:
        return "\n".join([lines[0], *("  " + line for line in text.splitlines()[1:] if line)])
    text = " ".join(lines) or type(err).__name__
    return text if len(text) <= 500 else text[:497] + "..."


GRACE = 20.0  # seconds a command may run on after its first interrupt before the process ends


class _Interrupts:
    """SIGINT while a command runs: the first raises ``KeyboardInterrupt`` in the main thread, as
    Python's own handler does; another one before the command has ended exits at once, saying
    so in one line (no traceback from code cleaning up, nor from the interpreter's exit).

    Python runs a signal's handler wherever the main thread is, and where that is a callback
    whose exceptions Python prints and drops (a fork's ``os.register_at_fork`` hooks, which every
    DataLoader worker's start runs, or a callback from C), the ``KeyboardInterrupt`` would be
    lost and a long command would run on. Such a drop reaches ``sys.unraisablehook``: there the
    interrupt is raised again, from a thread (a SIGINT sent to it again), once the main thread
    is out of the callback, until it lands where it propagates."""

    def __init__(self, where: str) -> None:
        self.where, self.count, self.said = where, 0, False
        self.pid = os.getpid()  # forked workers inherit the handler: theirs stays Python's
        self.previous: Any = None
        self.previous_hook: Any = None
        self.again = False  # a dropped interrupt is on its way again (not a new Ctrl-C)
        self.done = False  # the command is over: an interrupt still on its way is dropped
        self.in_hook = 0  # inside _dropped: an interrupt raised there would be lost
        self.threads: list[threading.Thread] = []

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # only the main thread may set a handler
        self.previous = signal.signal(signal.SIGINT, self._handle)
        self.previous_hook, sys.unraisablehook = sys.unraisablehook, self._dropped
        return True

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self.previous)
        sys.unraisablehook = self.previous_hook

    def _dropped(self, unraisable: Any) -> None:
        if unraisable.exc_type is KeyboardInterrupt and self.count and os.getpid() == self.pid:
            self.in_hook += 1
            try:
                self.again = True
                if not any(thread.is_alive() for thread in self.threads):
                    thread = threading.Thread(target=self._raise_again, name="mmproxy-interrupt",
                                              daemon=True)
                    thread.start()
                    self.threads.append(thread)
            finally:
                self.in_hook -= 1
            return
        self.previous_hook(unraisable)

    def _raise_again(self) -> None:
        """A thread's: raises the dropped interrupt again in the main thread once it has left
        the callback (and this hook, whose own exceptions nothing would see), with a real SIGINT
        to the main thread, which also ends a wait it is blocked in; again until it lands."""
        main = threading.main_thread().ident
        while main is not None:
            time.sleep(0.02)
            if not self.again or self.done:  # it landed, or the command is over
                return
            if not self.in_hook:
                signal.pthread_kill(main, signal.SIGINT)

    def _deadline(self) -> None:
        """A thread's: ends the process if the command still runs :data:`GRACE` seconds after
        the first interrupt, which something then swallowed without a trace (a ``except
        BaseException`` in library code, an error turned into another by a C++ callback)."""
        time.sleep(GRACE)
        if not self.done:
            os.write(2, f"{self.where}: interrupted (the command went on for {GRACE:.0f} s "
                        "after the interrupt; stopped)\n".encode())
            os._exit(130)

    def finish(self) -> None:
        """Waits for the interrupt on its way again, if any (dropped on arrival, :attr:`done`
        being set when the command returned), so that it never reaches the caller's code."""
        self.done = True
        for thread in self.threads:
            thread.join()

    def interrupted(self) -> None:
        """The command ended by an interrupt (a signal, or ``KeyboardInterrupt`` raised for
        one): says so; the next one exits at once."""
        self.count = max(self.count, 1)
        self.say()

    def say(self) -> None:
        if not self.said:
            self.said = True
            print(f"{self.where}: interrupted", file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.again:  # the interrupt a callback dropped, raised again
            if self.in_hook:
                return  # still in the hook: the thread sends it once more
            self.again = False
            if self.done:
                return
            raise KeyboardInterrupt
        self.count += 1
        if os.getpid() != self.pid:
            raise KeyboardInterrupt
        if self.count == 1:
            threading.Thread(target=self._deadline, name="mmproxy-interrupt-deadline",
                             daemon=True).start()
            raise KeyboardInterrupt
        if not self.said:
            os.write(2, f"{self.where}: interrupted\n".encode())
        os._exit(130)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit code (0, 1 for an error, 130 for an interrupt).

    As the ``mmproxy`` program (no ``argv``) its interrupt handling stays until the process
    exits; called with ``argv`` it gives the caller its own SIGINT handler back.
    """
    args, extra = build_parser().parse_known_args(argv)
    command_parser = args.__dict__.pop("command_parser")  # not a setting (bench writes them out)
    if extra:  # a mistyped option, a pattern the shell expanded: the command's own usage
        command_parser.error(unrecognized(command_parser, sys.argv[1:] if argv is None else argv,
                                          extra))
    for (command, option), module in _NEEDS.items():
        if args.command == command and getattr(args, option) and not importlib.util.find_spec(module):
            command_parser.error(f"--{option} needs {module}, which is not installed: "
                                 f"{install_hint(module)}")
    where = f"mmproxy {args.command}"
    interrupts = _Interrupts(where)
    installed = interrupts.install()
    try:
        try:
            code = int(args.func(args) or 0)
        finally:  # the command is over: an interrupt raised again from here on is dropped (it
            interrupts.done = True  # was counted), never raised in this function's handlers
        if interrupts.count:  # raised where it could not propagate (a callback from C)
            interrupts.say()
            return 130
        return code
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        interrupts.interrupted()
        return 130
    except Exception as err:
        from mmproxy.errors import MmproxyError

        if args.debug:
            traceback.print_exc()
        if interrupts.count:  # what an interrupt that was swallowed left behind
            interrupts.say()
            return 130
        if isinstance(err, ModuleNotFoundError) and err.name:
            message = f"needs {err.name}, which is not installed: {install_hint(err.name)}"
        elif isinstance(err, (MmproxyError, ValueError, OSError)):
            message = _one_line(err)
        else:  # not the user's doing
            message = (f"{type(err).__name__}: {_one_line(err)} (unexpected: please report it, "
                       "with the traceback --debug prints)")
        print(f"{where}: error: {message}", file=sys.stderr)
        if not args.debug:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        interrupts.finish()
        if installed and argv is not None:
            interrupts.restore()


if __name__ == "__main__":
    sys.exit(main())
