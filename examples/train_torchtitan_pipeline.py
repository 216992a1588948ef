"""torchtitan's own Llama3 split in pipeline stages, each under a DynamicPrecisionScheduler (gloo, CPU).

The stages search one plan together (the seed's loop on the stages: `autoprec.scheduler.pipeline_stage`):
the first window profiles each stage, then each measures its own layers and rank 0 plans for all of
them, with a memory budget per stage; promotions and demotions follow on any stage. The split is
torchtitan's: each stage keeps the whole model's module names (its ``layers`` ModuleDict loses the
other stages' blocks; the ends become None), so the plan's layer names are the whole model's.

Needs torchtitan 0.3.0 and what its model imports (``pip install --no-deps torchtitan==0.3.0
spmd_types`` and ``pip install tyro triton``; torch 2.13). Flex and varlen attention, torchtitan's
language-model backends, have no backward on a CPU: here its SDPA inner attention is put in their
place (on a GPU keep flex and pass the masks to ``schedule.step``).

    torchrun --nproc-per-node 2 examples/train_torchtitan_pipeline.py
    torchrun --nproc-per-node 2 examples/train_torchtitan_pipeline.py --memory-budget 0.7   # below what stage 1 reaches: one error, both train safe
"""

import argparse
import copy
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoprec as ap


def llama3(flavor: str) -> torch.nn.Module:
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()  # CPU: see the module docstring
    torch.manual_seed(0)  # every rank builds the same weights, then keeps its stage's
    model = llama3.model_registry(flavor).model.build()
    model.init_states()
    return model


def stage_of(model: torch.nn.Module, stage: int, stages: int) -> torch.nn.Module:
    """Stage ``stage`` of ``stages`` as torchtitan's pipeline split makes it: the blocks in its
    share (by their names in ``layers``), the embeddings on the first, the norm and head on the last."""
    part = copy.deepcopy(model)
    names = list(part.layers.keys())
    per = -(-len(names) // stages)
    for name in names[:stage * per] + names[(stage + 1) * per:]:
        del part.layers[name]
    if stage > 0:
        part.tok_embeddings = None
    if stage < stages - 1:
        part.norm, part.lm_head = None, None
    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel", help="torchtitan's Llama3 flavour (debugmodel: 6 blocks of width 256)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--window", type=int, default=4, help="monitor_window: steps per profiling / review window")
    parser.add_argument("--memory-budget", type=float, default=0.9, help="per stage, a fraction of its FP32 bytes")
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo")  # torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(message)s")
    torch.set_num_threads(1)
    model = stage_of(llama3(args.flavor), rank, world)
    scheduler = ap.DynamicPrecisionScheduler(model, monitor_window=args.window, memory_budget=args.memory_budget,
                                             formats=("fp32", "bf16", "fp8_e4m3", "int8"))
    schedule = ScheduleGPipe(PipelineStage(model, rank, world, torch.device("cpu")), n_microbatches=args.micro_batches,
                             loss_fn=scheduler.pipeline_loss(lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = 2048 if args.flavor == "debugmodel" else 128256
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: the first stage reads it, the last its targets
        x = torch.randint(0, vocab, (2 * args.micro_batches, 32), generator=g)
        losses: list = []
        with scheduler.precision_context():
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=torch.roll(x, -1, 1), losses=losses)
            else:
                schedule.step()
        scheduler.step(opt)
        opt.zero_grad(set_to_none=True)
        if losses:
            logging.warning("step %d: loss %.4f, %s", step, sum(float(v.detach()) for v in losses) / len(losses), scheduler.phase)
    if rank == 0 and scheduler.plan is not None:
        plan = scheduler.plan
        logging.info("plan %s, predicted seconds per stage %s, bytes per stage %s of %s", plan.format_counts(), plan.predicted.get("seconds_per_stage"),
                     plan.predicted.get("bytes_per_stage"), plan.budgets.get("memory_bytes_per_stage"))
    scheduler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
