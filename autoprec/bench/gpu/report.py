"""The short plain-text summary printed last by `autoprec bench --suite gpu` (the JSON has it all)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import GpuBenchResult

__all__ = ["format_table", "predicted_lines"]

_VERDICT = {True: "PASS", False: "FAIL", None: "n/a"}


def _status(row) -> str:
    return {True: "ok", False: "FAILED", None: "not run"}[row.ok]


def _why(row) -> str:
    return row.detail.get("error") or row.detail.get("skipped") or ""


def _layer_cell(row) -> str:
    if not row.ok:
        return _status(row)
    ratio = row.detail.get("ratio_to_baseline")
    return f"{row.detail['ms']:8.3f} {row.detail['tflops']:6.1f}" + (f" {ratio:5.2f}x" if ratio is not None else "       ")


def predicted_lines(rows) -> list[str]:
    """The eager layer rows' measured ratio to eager BF16 autocast beside the cost model's
    roofline one for the device (`layers.predicted_ratios`): where a search for this GPU
    planned from a machine that is not it (`costs.targets`) would be wrong."""
    both = [r for r in rows if r.ok and "predicted_ratio_to_eager_baseline" in r.detail and "ratio_to_eager_baseline" in r.detail]
    if not both:
        return []
    lines = [f"eager x eager bf16 autocast, measured / predicted on {both[0].detail['predicted_on']} (the cost model's roofline):"]
    return lines + [f"  {r.name}: {r.detail['ratio_to_eager_baseline']:.2f} / {r.detail['predicted_ratio_to_eager_baseline']:.2f}" for r in both]


def format_table(result: "GpuBenchResult") -> str:
    env = result.environment
    git = env.get("git") or {}
    commit = (git.get("commit") or "no git")[:10] + (" (dirty)" if git.get("dirty") else "")
    lines = [
        f"autoprec GPU suite{' (--smoke: sizes shrunk, timings meaningless)' if result.config.smoke else ''}: "
        f"{env.get('name')} {env.get('capability', '')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"{env.get('torchao')}, commit {commit}; {result.elapsed_s['total']:.0f} s",
    ]
    failed = [r for r in result.probe if r.ok is False]
    lines.append(f"correctness: {len(result.probe) - len(failed)}/{len(result.probe)} ok")
    lines += [f"  FAILED {r.name}: {_why(r) or r.detail}" for r in failed[:8]]
    if len(failed) > 8:
        lines.append(f"  ... and {len(failed) - 8} more (see the JSON)")

    shapes = [tuple(s) for s in result.config.layer_shapes]
    labels = list(dict.fromkeys(r.name.rsplit("/", 1)[1] for r in result.layers))
    cells = {(tuple(r.detail["shape"]), r.name.rsplit("/", 1)[1]): r for r in result.layers}
    lines.append("per layer fwd+bwd, each shape: ms, TFLOP/s, x compiled bf16 autocast")
    lines.append(f"  {'variant':<30}" + "".join(f"{'x'.join(map(str, s)):>23}" for s in shapes))
    for label in labels:
        row = [f"{_layer_cell(cells[(s, label)]):>23}" if (s, label) in cells else f"{'':>23}" for s in shapes]
        lines.append(f"  {label:<30}" + "".join(row))
    for r in result.layers:
        if r.ok is not True and _why(r):
            lines.append(f"  {r.name}: {_why(r)}")
            break  # one reason is enough here; all are in the JSON
    lines += predicted_lines(result.layers)

    timings = result.searched_plan.get("timings_ms")
    if timings:
        lines.append("end-to-end linear shapes, eager ms (the searched plan takes the faster):")
        for shape, ms in timings.items():
            bf16, fp8 = ms.get("bf16"), ms.get("fp8_e4m3")
            cell = " ".join(f"{name} {'-' if v is None else f'{v:.3f}'}" for name, v in (("bf16", bf16), ("fp8", fp8)))
            lines.append(f"  {shape:<22} {cell}")

    base = next((r for r in result.e2e if r.name.endswith("/bf16_autocast") and r.ok), None)
    lines.append(f"end to end ({result.config.e2e.steps} steps, eager; searched plan from {result.searched_plan['source']}):")
    for r in result.e2e:
        if not r.ok:
            lines.append(f"  {r.name.split('/', 1)[1]:<15} {_status(r)}: {_why(r)}")
            continue
        d = r.detail
        ratio = f"{d['tokens_per_s'] / base.detail['tokens_per_s']:.2f}x" if base is not None else "-"
        memory = f"{d['peak_memory_bytes'] / 2**30:.1f} GiB" if d.get("peak_memory_bytes") else "-"
        formats = ", ".join(f"{k} {v}" for k, v in d.get("plan_formats", {}).items()) or "torch.autocast"
        lines.append(
            f"  {r.name.split('/', 1)[1]:<15} {d['tokens_per_s']:10.0f} tok/s {ratio:>6}  peak {memory:>9}  "
            f"loss {d['loss_first']:.3f} -> {d['loss_last']:.3f}  [{formats}]"
        )
    lines.append("targets:")
    for t in result.targets:
        value = "-" if t.value is None else f"{t.value:.3f}"
        lines.append(f"  {_VERDICT[t.passed]:<4} {t.name}: {value} (threshold {t.threshold}) -- {t.detail}")
    return "\n".join(lines)
