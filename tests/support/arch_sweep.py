"""The architecture sweep: every model type that transformers (and diffusers) ship with a head people
train, built from a tiny config generated here (nothing listed by hand, nothing downloaded), and
trained through the README loop under a `DynamicPrecisionScheduler` made as a new user makes it.

`cases` lists the model types of transformers' auto mappings, each with its first head of
`HEADS` (causal LM, masked LM, seq2seq, sequence classification, image classification, CTC), and
diffusers' UNet2D, UNet2DCondition, DiT and VAE; `build` makes one with `tiny_config` (every size
field transformers' configs use shrunk to 2 layers of width 32, wherever in the config it sits:
nested text / vision / audio configs included) and a batch as its users feed it; `run` trains it
and says how it ended (`Row`): ``planned`` (a plan in force at the end, finite losses, the metered
bytes of a planned step within the memory budget and the plan's measured loss increase within the
accuracy budget), ``refused`` (the scheduler said why no plan exists: an infeasible budget, with
the smallest reachable), ``failed`` (anything else: a crash, a search error, a budget broken), or
``skipped`` (not built: its construction needs a download or a package this machine lacks, or the
generated config does not satisfy the model; or not run: a plain FP32 step of it is too slow on
this CPU for the sweep: named with the reason).

`tests/models/test_arch_sweep.py` runs a rotating sample; `benchmarks/arch_sweep.py` the whole sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import math
import os
import random
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import torch

from support.conformance import saved_bytes
from autoprec.errors import AutoprecError
from autoprec.runtime import EmulationWarning
from autoprec.scheduler import DynamicPrecisionScheduler

__all__ = ["HEADS", "Case", "Row", "cases", "rotating_seed", "buildable", "build", "run", "tiny_config"]

VOCAB = 96
WIDTH = 32
BATCH = 4
LENGTH = 16
IMAGE = 32
MAX_PARAMETERS = 2_000_000
MAX_STEP_SECONDS = 3.0  # a plain FP32 step's (its first, so compilation and caches included)
AUDIO = 1600  # samples: a CTC model's convolutional front end shrinks them ~320x

# (head, transformers' mapping of model type -> class name), in the order a type's head is chosen.
HEADS = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES"),
)
DIFFUSERS = ("UNet2DModel", "UNet2DConditionModel", "DiTTransformer2DModel", "AutoencoderKL")

# Config fields by what they size, as transformers' configs name them (every config uses some).
_LAYERS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
           "num_encoder_layers", "depth", "encoder_depth", "decoder_depth", "text_layers", "vision_layers"}
_WIDTH = {"hidden_size", "d_model", "n_embd", "dim", "embed_dim", "embedding_size", "encoder_hidden_size", "decoder_hidden_size",
          "word_embed_proj_dim", "projection_dim", "hidden_dim"}
_HEADS_N = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
            "num_decoder_attention_heads", "encoder_num_attention_heads", "decoder_num_attention_heads"}
_KV_HEADS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_key_value_groups"}
_FFN = {"intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size",
        "decoder_intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"}
_POSITIONS = {"max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "n_ctx",
              "max_source_positions", "max_target_positions"}
_TOKEN_IDS = {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
              "mask_token_id", "unk_token_id"}
_SIZES = {
    **{k: 2 for k in _LAYERS}, **{k: WIDTH for k in _WIDTH}, **{k: 2 for k in _HEADS_N}, **{k: 1 for k in _KV_HEADS},
    **{k: 2 * WIDTH for k in _FFN}, **{k: 64 for k in _POSITIONS},
    "head_dim": WIDTH // 2, "d_kv": WIDTH // 2, "kv_channels": WIDTH // 2, "attention_head_size": WIDTH // 2,
    "vocab_size": VOCAB, "type_vocab_size": 2, "num_labels": 3,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "image_size": IMAGE, "patch_size": 4, "num_channels": 3, "window_size": 4, "state_size": 4, "conv_kernel": 4,
    "rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": WIDTH // 2, "kv_lora_rank": 16, "q_lora_rank": 16,
    "n_words": VOCAB, "emb_dim": WIDTH, "entity_vocab_size": 16, "entity_emb_size": WIDTH, "mask_time_prob": 0.0, "mask_feature_prob": 0.0,
    "num_buckets": 8, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "relative_attention_num_buckets": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "dropout": 0.0, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "dropout_rate": 0.0, "resid_pdrop": 0.0,
    "embd_pdrop": 0.0, "attn_pdrop": 0.0, "hidden_dropout": 0.0, "attention_dropout": 0.0,
    # state-space mixers (Falcon-H1, Mamba-2, Bamba): heads x head size = the inner width, a short scan chunk
    "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_ssm": 32, "mamba_d_state": 4, "mamba_chunk_size": 16, "chunk_size": 16,
    "use_cache": True,  # the model's default, kept on
}
# List-valued stage fields (Swin, ConvNeXt, ResNet): two stages, shrunk.
_STAGES = {"depths": [1, 1], "hidden_sizes": [16, WIDTH], "num_heads": [2, 2], "embed_dims": [16, WIDTH], "num_attention_heads": [2, 2],
           "sr_ratios": [2, 1], "mlp_ratios": [2, 2], "strides": [2, 2], "patch_sizes": [4, 2], "kernel_sizes": [3, 3],
           "layer_types": None, "num_groups": [1, 1], "block_sizes": [1, 1],
           # an audio model's convolutional front end: two layers, 20x down in time
           "conv_dim": [WIDTH, WIDTH], "conv_stride": [5, 4], "conv_kernel": [10, 8]}


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    head: str
    cls: str  # the class to build: transformers' (or diffusers' for head "diffusion")
    library: str = "transformers"


@dataclasses.dataclass
class Row:
    """How one model type's run ended (`run`)."""

    model_type: str
    head: str
    cls: str
    outcome: str  # planned, refused, failed or skipped
    reason: Optional[str] = None  # refused / failed / skipped: why (one line)
    layers: int = 0  # layers the plan covers
    formats: dict = dataclasses.field(default_factory=dict)  # the plan in force: format -> layers
    recompute: int = 0  # recomputed blocks
    memory_ratio: Optional[float] = None  # a planned step's metered bytes / an FP32 step's
    measured_increase: Optional[float] = None  # the last planned check's
    loss_ratio: Optional[float] = None  # mean loss of the last quarter of steps / the same model trained in FP32
    planned_at: Optional[int] = None  # the step from which a plan was in force
    skipped_search_steps: int = 0  # steps of the search whose loss was non-finite (skipped: the weights untouched)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cases() -> list[Case]:
    """Every model type of transformers' auto mappings with a head of `HEADS` (the first one it
    has), then diffusers' models; sorted by model type."""
    import transformers.models.auto.modeling_auto as auto

    chosen: dict[str, Case] = {}
    for head, mapping in HEADS:
        for model_type, cls in getattr(auto, mapping).items():
            if model_type not in chosen and isinstance(cls, str):
                chosen[model_type] = Case(model_type, head, cls)
    out = [chosen[t] for t in sorted(chosen)]
    return out + [Case(f"diffusers-{name}", "diffusion", name, "diffusers") for name in DIFFUSERS]


def rotating_seed() -> int:
    """The seed of a CI run's sample: ``AUTOPREC_SWEEP_SEED``, else the day of the year (CI runs
    see other model types over time; the failing seed is in the test's id and the environment)."""
    return int(os.environ.get("AUTOPREC_SWEEP_SEED", datetime.date.today().timetuple().tm_yday))


def buildable(count: int, seed: int) -> list[Case]:
    """``count`` cases that build and run a forward, in ``seed``'s shuffled order of `cases` (a
    type whose generated config does not build is passed over). Costs a constructor and a forward
    per case tried."""
    every = cases()
    random.Random(seed).shuffle(every)
    picked = []
    for case in every:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, make, loss = build(case)
                loss(model, make(0))
        except Exception:
            continue
        picked.append(case)
        if len(picked) == count:
            break
    return picked


def _shrunk(defaults: dict) -> dict:
    """The overrides that make a config of ``defaults`` (its ``to_dict()``) tiny, nested configs
    (dicts) included: every size field it has, shrunk (`_SIZES`, `_STAGES`)."""
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if isinstance(value, dict) and key.endswith("config"):
            out[key] = {**value, **_shrunk(value)}
        elif key in _STAGES and isinstance(value, (list, tuple)) and _STAGES[key] is not None:
            out[key] = list(_STAGES[key])
        elif key in _SIZES and value is not None and not isinstance(value, (list, tuple, dict)):
            target = _SIZES[key]
            out[key] = type(value)(target) if isinstance(value, (int, float)) and not isinstance(value, bool) else target
        elif key in _TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1 - list(sorted(_TOKEN_IDS)).index(key)
        elif key in ("layer_types", "block_types", "attn_layer_indices", "layers_block_type") and isinstance(value, (list, tuple)) and value:
            out[key] = list(value[:2])
    return out


def tiny_config(model_type: str):
    """``model_type``'s config, every size field shrunk (module docstring), 3 labels for a
    classification head; raises what the config's own validation raises when the shrunk sizes do
    not fit it."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    overrides = {**_shrunk(default.to_dict()), "num_labels": 3}
    config = cls(**overrides)
    if getattr(config, "decoder_start_token_id", None) is None and getattr(config, "is_encoder_decoder", False):
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    for key, value in overrides.items():  # fields a constructor derives rather than takes
        if not isinstance(value, dict) and getattr(config, key, value) != value:
            with contextlib.suppress(Exception):
                setattr(config, key, value)
    return config


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    """Rows counting up from a random start (mod the vocabulary, above the special ids): learnable."""
    start = torch.randint(0, VOCAB - 8, (batch, 1), generator=torch.Generator().manual_seed(seed))
    return 4 + (start + torch.arange(length)) % (VOCAB - 8)


def _text_batch(head: str, config, seed: int) -> dict:
    ids = _tokens(BATCH, LENGTH, seed)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if head == "sequence-classification":
        batch["labels"] = ids[:, 0] % 3
    elif head == "seq2seq":
        batch["labels"] = _tokens(BATCH, LENGTH // 2, seed + 7)
    else:
        batch["labels"] = ids
    return batch


def _image_batch(config, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    size = getattr(config, "image_size", IMAGE)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(config, "num_channels", 3)
    labels = torch.randint(0, 3, (BATCH,), generator=gen)
    pixels = torch.randn(BATCH, channels, size, size, generator=gen)
    pixels[torch.arange(BATCH), labels % channels] += 1.0
    return {"pixel_values": pixels, "labels": labels}


def _ctc_batch(config, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(1, min(VOCAB, config.vocab_size) - 1, (BATCH, 3), generator=gen)
    audio = torch.randn(BATCH, AUDIO, generator=gen) * 0.1 + labels[:, :1].float() / VOCAB
    return {"input_values": audio, "labels": labels}


def _diffusers(name: str) -> tuple[torch.nn.Module, Callable[[int], dict], Callable]:
    """A tiny diffusers model, its batch maker and its loss (noise prediction's MSE; a VAE's
    reconstruction)."""
    import diffusers

    if name == "UNet2DModel":
        model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                                      down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                                      norm_num_groups=8)
    elif name == "UNet2DConditionModel":
        model = diffusers.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
                                               down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                               up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
                                               attention_head_dim=8, norm_num_groups=8)
    elif name == "DiTTransformer2DModel":
        model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2,
                                                sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=8)
    else:
        model = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                                        norm_num_groups=8, sample_size=16)
    channels = model.config.in_channels
    size = 8 if name == "DiTTransformer2DModel" else 16

    def batch(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        clean = torch.randn(BATCH, channels, size, size, generator=gen)
        if name == "AutoencoderKL":
            return {"sample": clean}
        noise = torch.randn(BATCH, channels, size, size, generator=gen)
        out = {"sample": clean + noise, "timestep": torch.randint(0, 10, (BATCH,), generator=gen), "_target": noise}
        if name == "UNet2DConditionModel":
            out["encoder_hidden_states"] = torch.randn(BATCH, 4, 16, generator=gen)
        if name == "DiTTransformer2DModel":
            out["hidden_states"] = out.pop("sample")
            out["class_labels"] = torch.randint(0, 10, (BATCH,), generator=gen)
        return out

    def loss(model, batch):
        inputs = {k: v for k, v in batch.items() if not k.startswith("_")}
        out = model(**inputs).sample
        target = batch.get("_target", batch.get("sample"))
        return torch.nn.functional.mse_loss(out.float(), target)

    return model, batch, loss


def build(case: Case, seed: int = 0) -> tuple[torch.nn.Module, Callable[[int], dict], Callable]:
    """``(model, batch(seed) -> dict, loss(model, batch) -> tensor)`` for ``case``, the model as
    its users call it (keyword inputs with labels, the loss from its output)."""
    torch.manual_seed(seed)
    if case.library == "diffusers":
        return _diffusers(case.cls)
    import transformers

    config = tiny_config(case.model_type)
    cls = getattr(transformers, case.cls)
    # Counted on the meta device first: a size field the generator does not know keeps its full
    # value, and materialising such a model took the machine's memory (t5gemma, whose encoder and
    # decoder sub-configs are not shrunk: 5.6 billion parameters, the process killed at 20 GiB).
    # A class that cannot be built on meta is built as it is.
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
    except Exception:
        size = 0
    if size <= MAX_PARAMETERS:
        model = cls(config)
        size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the generated config keeps {size:,} parameters (over {MAX_PARAMETERS:,}): a size field it does not shrink")
    if case.head == "image-classification":
        make = lambda s: _image_batch(config, s)  # noqa: E731
    elif case.head == "ctc":
        make = lambda s: _ctc_batch(config, s)  # noqa: E731
    else:
        accepted = set(inspect.signature(model.forward).parameters)
        make = lambda s: {k: v for k, v in _text_batch(case.head, config, s).items() if k in accepted or "kwargs" in accepted}  # noqa: E731

    def loss(model, batch):
        return model(**batch).loss

    return model, make, loss


def settings(memory: float, accuracy: float, window: int) -> dict:
    """A new user's scheduler: 8 to 32 bits, the budgets, a short window; defaults otherwise (a
    planned check every 2nd step, so a short run averages several)."""
    return dict(min_precision=8, max_precision=32, monitor_window=window, monitor_steps=2, sample_every=2,
                memory_budget=memory, accuracy_budget=accuracy, search_slice=None)


def _step(model, loss_fn, batch, scheduler: "DynamicPrecisionScheduler | None", optimizer) -> float:
    context = scheduler.precision_context() if scheduler is not None else contextlib.nullcontext()
    with context:
        loss = loss_fn(model, batch)
    if scheduler is not None:
        scheduler.backward(loss)
        scheduler.step(optimizer)
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _refusal(error: str) -> bool:
    """Whether a search's error is the scheduler refusing the budgets (no plan meets them), not a
    failure of its own."""
    return "InfeasibleBudgetError" in error or "no plan meets" in error


def run(case: Case, *, max_steps: int = 120, after: int = 16, window: int = 6, memory: float = 0.6, accuracy: float = 0.05,
        seed: int = 0) -> Row:
    """Train ``case`` through the README loop until its plan has been in force ``after`` steps, or
    its search failed, or ``max_steps`` (and the same model in plain FP32 on the same batches, from
    the same weights, for the loss ratio) and classify the run (`Row`). How many steps a search
    takes depends on what its probes and trials measure (another plan, another round under a
    loaded CPU: 24 steps alone, 40 beside three busy processes for a tiny Doge), so the run is
    as long as its search, not a fixed count that a slow machine's search outlasts."""
    import copy

    start = time.perf_counter()
    row = Row(case.model_type, case.head, case.cls, "skipped")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, make, loss_fn = build(case, seed)
            batches = [make(seed + i) for i in range(max_steps)]
            model.train()
            plain_start = time.perf_counter()
            _step(copy.deepcopy(model), loss_fn, batches[0], None, torch.optim.SGD(model.parameters(), lr=0.0))  # it runs at all
            plain = time.perf_counter() - plain_start
    except Exception as exc:  # not built: a download, a missing package, a config the generator does not satisfy
        row.reason = "not built: " + _one_line(exc)
        row.seconds = time.perf_counter() - start
        return row
    if plain > MAX_STEP_SECONDS:  # the model's own CPU path (a sequential scan in Python): no run fits the sweep
        row.reason = f"not run: a plain FP32 step of the tiny model takes {plain:.1f} s on this CPU (the sweep allows {MAX_STEP_SECONDS:.0f} s)"
        row.seconds = time.perf_counter() - start
        return row
    reference = copy.deepcopy(model)
    scheduler = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)  # no FP8 / INT8 kernel for attention or convolutions on CPU
            warnings.simplefilter("ignore", UserWarning)
            scheduler = DynamicPrecisionScheduler(**settings(memory, accuracy, window))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for i, batch in enumerate(batches):
                losses.append(_step(model, loss_fn, batch, scheduler, optimizer))
                if scheduler.plan is not None and row.planned_at is None:
                    row.planned_at = i
                refused = scheduler.last_search_error is not None and _refusal(scheduler.last_search_error)  # final; other failures retry
                if (row.planned_at is not None and i >= row.planned_at + after) or refused:
                    break
            ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
            ref_losses = [_step(reference, loss_fn, batch, None, ref_optimizer) for batch in batches[:len(losses)]]
            quarter = max(1, len(losses) // 4)
            searched = losses[:row.planned_at if row.planned_at is not None else len(losses)]
            row.skipped_search_steps = sum(not math.isfinite(x) for x in searched)
            if all(math.isfinite(x) for x in losses[-quarter:] + ref_losses) and sum(ref_losses[-quarter:]) > 0:
                row.loss_ratio = sum(losses[-quarter:]) / sum(ref_losses[-quarter:])
            plan = scheduler.plan
            if plan is not None:
                row.layers, row.formats, row.recompute = len(plan), plan.format_counts(), len(plan.recompute)
                last = batches[len(losses) - 1]
                row.memory_ratio = saved_bytes(model, last, scheduler, loss_fn) / saved_bytes(reference, last, None, loss_fn)
            check = scheduler.last_check
            row.measured_increase = check.increase if check is not None else None
            row.outcome, row.reason = _classify(row, scheduler, losses[row.planned_at or 0:], memory, accuracy)
    except AutoprecError as exc:  # the scheduler refused the model or a setting, with its reason
        row.outcome, row.reason = "refused", _one_line(exc)
    except Exception as exc:
        row.outcome, row.reason = "failed", _one_line(exc) + " | " + traceback.format_exc().strip().splitlines()[-3].strip()[:200]
    finally:
        if scheduler is not None:
            with contextlib.suppress(Exception):
                scheduler.close()
    row.seconds = time.perf_counter() - start
    return row


def _classify(row: Row, scheduler: DynamicPrecisionScheduler, planned_losses: list, memory: float, accuracy: float) -> tuple[str, Optional[str]]:
    """``planned_losses``: the training losses from the step the plan came into force (a search
    step whose candidate's forward overflowed was skipped, the weights untouched, as a loss
    scaler skips a step: the row counts those)."""
    error = scheduler.last_search_error
    if scheduler.plan is None or scheduler.phase != "planned":
        if error is not None and _refusal(error):
            return "refused", error.splitlines()[0][:300]
        return "failed", f"no plan in force at the end (phase {scheduler.phase}): {error or 'no search error'}"[:300]
    if not all(math.isfinite(x) for x in planned_losses):
        return "failed", "a non-finite training loss with the plan in force"
    if row.memory_ratio is not None and row.memory_ratio > memory:
        return "failed", f"a planned step's metered bytes are {row.memory_ratio:.3f} of FP32's, over the {memory} budget"
    if row.measured_increase is not None and row.measured_increase > accuracy:
        return "failed", f"the plan's measured loss increase {row.measured_increase:.4f} is over the {accuracy} budget"
    return "planned", None
