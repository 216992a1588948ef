"""`run`: a test's scenario on `WORLD` gloo CPU ranks, spawned, each rank's result returned
(the tensor- and pipeline-parallel tests)."""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def run(scenario, tmp_path, *args):
    """``scenario(rank, *args)`` on every rank (a module-level function, picklable), each in a
    gloo process group rendezvousing through a file under ``tmp_path``; its results in rank order."""
    os.makedirs(tmp_path, exist_ok=True)
    mp.spawn(_entry, args=(scenario, str(tmp_path), args), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _entry(rank, scenario, tmp, args):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        torch.save(scenario(rank, *args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
