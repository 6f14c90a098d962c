"""How tests start several processes: `fork_ranks` runs a function on ranks forked from the test's process
(the 2-process DDP checks), `run_commands` runs a list of `sentemb` commands one after the other on them,
`torchrun` runs a program under torchrun, as users launch it; `run_script` runs a script (a benchmark's smoke
run) in a child forked from the test's process.

Several 2-process fits then share one pair of ranks; a fresh interpreter would cost about 9 s of imports a
rank on the 2-core machine (torch, Lightning, torchmetrics). A fit stopped by SIGTERM (exit status 143,
`tests.test_resume.TerminateAt`) is reported on stdout, and the next command runs: it may be the resume.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from lightning_sentemb.lightning_cli import lightning_main

REPO = Path(__file__).resolve().parents[1]


def torchrun(program: list[str], processes: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node <processes> <program>`: its elastic agent serves the store on
    MASTER_PORT (a free port: tests run side by side) and starts the ranks, as on a cluster."""
    return run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(processes),
                *program], timeout)


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`command` in a session of its own: past `timeout`, all its processes are killed (torchrun's ranks too,
    which killing torchrun alone leaves behind)."""
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True,
                          env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fork_ranks(target: Callable[..., None], *args: object, processes: int = 2) -> None:
    """`target(*args)` on `processes` ranks forked from this process, each with the environment a launcher
    (torchrun, srun) gives its ranks: rank, world size, a free address. Lightning's `ddp` then starts no process
    of its own, and the ranks start with this process's imports (a fresh interpreter costs ~9 s a rank). The
    launch itself is tested as users type it: torchrun in tests/test_resume.py and tests/test_mixture_ddp.py,
    Lightning's relaunch in tests/test_fsdp.py."""
    mp.start_processes(forked_rank, args=(target, args, free_port(), processes), nprocs=processes, join=True,
                       start_method="fork")


def forked_rank(rank: int, target: Callable[..., None], args: tuple, port: int, processes: int) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it hangs), nor may
    os.environ.update(OMP_NUM_THREADS="1",  # Lightning's strategy raise the thread count again
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(processes), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", WANDB_MODE="disabled")
    target(*args)


def run_commands(commands: list[list[str]]) -> None:
    """Each `sentemb` command in this process, one after the other; a fit stopped by SIGTERM is said on stdout."""
    for index, command in enumerate(commands):
        try:
            lightning_main(command)
        except SystemExit as stop:  # a fit stopped by SIGTERM (last.ckpt saved): the next command may resume it
            if stop.code != 143:
                raise
            # both ranks say it on one pipe: after what is buffered, in one write below the pipe's atomic
            # size (a flush of a long buffer is split, and the two ranks' lines once ran together)
            sys.stdout.flush()
            os.write(sys.stdout.fileno(), f"launch: command {index} stopped by SIGTERM\n".encode())


def run_script(script: Path, *argv: str, timeout: float = 600) -> None:
    """`python script argv...` from the repository root, in a child forked from this process: the script runs
    as `__main__` with this process's imports done (a benchmark's smoke run then pays no interpreter start)."""
    child = mp.get_context("fork").Process(target=script_main, args=(str(script), list(argv)))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"{script.name} {' '.join(argv)} exited with {child.exitcode}"


def script_main(script: str, argv: list[str]) -> None:
    os.chdir(REPO)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # as `python script` puts its folder first
    runpy.run_path(script, run_name="__main__")
