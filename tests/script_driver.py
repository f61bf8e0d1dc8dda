"""Run several command lines of the repository's scripts in ONE Python process, each as `python SCRIPT ARGS...` runs it
(sys.argv, __name__ == "__main__", a world of one, the exit status and the traceback of an uncaught error), so that
torch and transformers are imported once for all of them instead of once per subprocess.

    python tests/script_driver.py CASES.json

CASES.json: {"cases": [{"name": ..., "argv": [SCRIPT, *ARGS]}, ...], "env": {...}}; an argv may also be
["-m", MODULE, *ARGS], as `python -m MODULE ARGS...` (tools/). For each case, in order, it writes
NAME.out, NAME.err (what the case wrote to file descriptors 1 and 2) and NAME.rc (its exit status) beside CASES.json.
tests/conftest.py:run_scripts is the way in."""
import json
import os
import runpy
import time
import signal
import sys
import traceback
from pathlib import Path

# the process-group variables a case's world of one sets in os.environ: a fresh `python script.py` has none of them
GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_case(argv: list[str], out: Path, err: Path) -> int:
    """Run one command line as __main__ with fds 1 and 2 sent to `out` and `err`; its exit status."""
    for k in GROUP_VARS:
        os.environ.pop(k, None)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    hook, saved_argv, saved_path = sys.excepthook, sys.argv, list(sys.path)
    sys.stdout.flush(), sys.stderr.flush()
    fds = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            if argv[0] == "-m":  # as `python -m MODULE`: the current folder first on the path
                sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # as `python SCRIPT`: the script's folder first on the path
                sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as x:  # what the interpreter makes of sys.exit(x.code)
            code = 0 if x.code is None else x.code if isinstance(x.code, int) else 1
            if not isinstance(x.code, (int, type(None))):
                print(x.code, file=sys.stderr)
        except BaseException as x:  # noqa: BLE001 - an uncaught error: its traceback (through the script's hook), 1
            sys.excepthook(type(x), x, x.__traceback__)
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.close(fds[0]), os.close(fds[1])
            sys.argv, sys.path[:], sys.excepthook = saved_argv, saved_path, hook
            for s, h in handlers.items():
                signal.signal(s, h)
    if "torch.distributed" in sys.modules:  # only if a case imported torch
        import torch
        import torch.distributed as dist
        if dist.is_initialized():  # a case that died mid-run leaves its group behind; the next one forms its own
            dist.destroy_process_group()
        torch.use_deterministic_algorithms(False)
    return code


def main(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    os.environ.update(spec.get("env", {}))
    for case in spec["cases"]:
        base, start = str(spec_path.parent / case["name"]), time.perf_counter()
        try:
            code = run_case(case["argv"], Path(base + ".out"), Path(base + ".err"))
        except BaseException:  # noqa: BLE001 - the driver itself failed around the case: say so in the case's files
            with open(base + ".err", "a") as f:
                f.write("script_driver: " + traceback.format_exc())
            code = 1
        Path(base + ".rc").write_text(str(code))
        print(f"{case['name']}: exit {code}, {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
