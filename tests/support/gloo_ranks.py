"""`run`: a test's scenario on `WORLD` gloo CPU ranks, spawned, each rank's result returned
(the data-, tensor- and pipeline-parallel tests)."""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def run(scenario, tmp_path, *args, world=WORLD, timeout=None):
    """``scenario(rank, *args)`` on ``world`` ranks (a module-level function, picklable), each in a
    gloo process group rendezvousing through a file under ``tmp_path``; its results in rank order.
    ``timeout`` (a ``datetime.timedelta``): how long a collective waits before it fails (None:
    torch's default), for a test of something that once hung."""
    os.makedirs(tmp_path, exist_ok=True)
    mp.spawn(_entry, args=(scenario, str(tmp_path), args, world, timeout), nprocs=world, join=True)
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _entry(rank, scenario, tmp, args, world, timeout):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            **({"timeout": timeout} if timeout is not None else {}))
    try:
        torch.save(scenario(rank, *args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # torch's FSDP2 on gloo aborts at interpreter exit in a few runs in a hundred ("terminate called
    # without an active exception", after the group is destroyed; a plain FSDP2 loop without
    # autoprec does the same). The result is saved: leave without that C++ teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
