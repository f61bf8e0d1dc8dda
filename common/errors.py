"""User errors: a bad flag, file, row, checkpoint or batch geometry is reported as one line, printed once, without a
traceback, and the run exits 2. A bug (any other exception) keeps its traceback and exits 1. RL_TRACEBACK=1 shows
the traceback of a user error too (debugging).

    raise UsageError(f"--group-size {g}: a group of one has advantage 0; use --group-size 2 or more")
    ...
    if __name__ == "__main__":
        with user_errors():
            main(cli(Args, __doc__))

Under torchrun every rank usually finds the same error (the same flags, the same files): rank 0 prints it, the other
ranks stay silent; an error only some ranks find is printed by the first of them (one line per machine: the ranks
of a machine agree through a marker file in its temp folder). The message also goes to torchrun's error file
(TORCHELASTIC_ERROR_FILE), so the launcher's failure report names it instead of "To enable traceback see ...".
"""
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

USAGE_EXIT_CODE = 2  # as argparse's: the command cannot run as given
TRACEBACK_ENV = "RL_TRACEBACK"
OTHER_RANKS_WAIT_S = 1.0  # ranks other than 0 wait this long, so rank 0 prints an error that every rank found


class UsageError(ValueError):
    """What the user passed or owns is wrong (a flag, a file, a dataset row, a checkpoint, the batch geometry); the
    message says what and how to fix it. A ValueError, so `except ValueError` still catches it."""


def _first_to_report(message: str, rank: int) -> bool:
    """True for the one rank of this machine that prints `message` (rank 0 if it has it too)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    if rank != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    # one launch of torchrun on this machine: its run id, its pid (the ranks' parent) and restart count
    launch = "|".join([os.environ.get("TORCHELASTIC_RUN_ID", ""), str(os.getppid()),
                       os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), message])
    marker = Path(tempfile.gettempdir()) / f"rl-post-train-error-{hashlib.sha1(launch.encode()).hexdigest()[:16]}"
    for _ in range(2):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            try:
                if time.time() - marker.stat().st_mtime < 60:
                    return False  # another rank of this launch printed it
                marker.unlink()  # left by an earlier launch whose launcher had the same pid
            except OSError:
                return False
        except OSError:  # no writable temp folder: better twice than never
            return True
    return False


def report(e: BaseException) -> None:
    """Print the user error `e` once (see the module docstring) and put it into torchrun's error file."""
    rank, message = int(os.environ.get("RANK", "0")), str(e)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # the launcher's failure report shows this message (no "py_callstack": no traceback)
        try:
            Path(error_file).write_text(json.dumps({"message": {"message": f"{type(e).__name__}: {message}",
                                                                "extraInfo": {"timestamp": str(int(time.time()))}}}))
        except OSError:
            pass
    if _first_to_report(message, rank):
        where = f" (rank {rank})" if rank else ""
        print(f"error{where}: {message}", file=sys.stderr, flush=True)


@contextmanager
def user_errors():
    """Around a script's main: a UsageError is printed once, without a traceback, and the process exits 2
    (RL_TRACEBACK=1: raised as it is, with its traceback). Any other exception passes through untouched."""
    try:
        yield
    except UsageError as e:
        if os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
            raise
        # torchrun ends the other ranks with SIGTERM when one exits: no clean-stop message from them (common/stop.py)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        report(e)
        raise SystemExit(USAGE_EXIT_CODE) from None
