"""Helpers of `gpu_session.sh all`: stamp a JSON with where it ran, and print the session's figures.

    python benchmarks/gpu_session_report.py stamp PLAN.json OUT.json   # PLAN.json inside {"plan": ...} with device, torch, CUDA, commit
    python benchmarks/gpu_session_report.py summary OUT_DIR             # one line per figure of every JSON in OUT_DIR

The summary is printed last by the session (the device tool returns the last 12,000 characters of
output); the JSONs hold everything.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path


def environment() -> dict:
    import torch

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()), "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def stamp(source: Path, target: Path) -> None:
    target.write_text(json.dumps({**environment(), "plan": json.loads(source.read_text())}, indent=1) + "\n")


def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _gb(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _profile_lines(profiles: dict) -> list[str]:
    """One line per variant of a benchmark's ``profile`` (`autoprec.bench.step_profile`), per step."""
    lines = []
    for name, p in (profiles or {}).items():
        if "kernels" in p:
            counts = (f"{p['kernels']:.0f} kernels ({p['launches']:.0f} launches, {p['syncs']:.0f} syncs, {p['memcpy']:.0f} memcpy), "
                      f"kernel time {p['kernel_ms']:.2f} ms")
        else:
            counts = f"{p.get('aten_ops', 0):.0f} aten ops"
        top = ", ".join(f"{t['name'][:48]} {t['calls']:.0f}x {t['ms']:.2f} ms" for t in p["top"][:4])
        lines.append(f"  profile {name}: host {p['host_ms']:.2f} / wall {p['wall_ms']:.2f} ms a step, {counts}; top: {top}")
    return lines


def _where_time_goes(result: dict) -> list[str]:
    """A scheduler_costs.py result's host time per step against its step time (medians), then its
    profile lines."""
    host, step = result.get("median_host_s") or {}, result.get("median_step_s") or {}
    lines = ["  host time to issue a step / the step (median): " + ", ".join(
        f"{k} {_f(1e3 * v)} / {_f(1e3 * step[k] if k in step else None)} ms" for k, v in host.items())] if host else []
    return lines + _profile_lines(result.get("profile"))


def summary(folder: Path) -> list[str]:
    lines = []

    def load(name: str):
        path = folder / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            lines.append(f"{name}: missing or unreadable")
            return None

    suite = load("gpu_suite.json")
    if suite is not None:
        env = suite["environment"]
        rows = [*suite["correctness"], *suite["layers"], *suite["e2e"]]
        lines.append(f"gpu suite on {env.get('name')} (torch {env.get('torch')}, CUDA {env.get('cuda')}, {env.get('torchao')}): "
                     f"{sum(1 for r in rows if r['ok'])} rows ok, {sum(1 for r in rows if r['ok'] is False)} failed, "
                     f"{sum(1 for r in rows if r['ok'] is None)} not run; {_f(suite['elapsed_s'].get('total'), '.0f')} s")
        for t in suite["targets"]:
            lines.append(f"  {'ok ' if t['passed'] else 'MISS' if t['passed'] is False else 'n/a '} {t['name']}: {_f(t['value'], '.3f')} (threshold {t['threshold']})")
        first = suite["layers"][0]["detail"].get("shape") if suite["layers"] else None
        lines.extend(_profile_lines({r["name"]: r["detail"]["profile"] for r in suite["layers"]  # the first shape's variants
                                     if r["ok"] and r["detail"].get("shape") == first and "profile" in r["detail"]}))
        for r in suite["e2e"]:
            d = r.get("detail") or {}
            lines.append(f"  {r['name']}: {_f(d.get('tokens_per_s'), '.0f')} tok/s, peak {_gb(d.get('peak_memory_bytes'))} GiB, loss {_f(d.get('loss_last'), '.3f')}")
    for mode in ("eager", "compiled"):
        sc = load(f"scheduler_costs_{mode}.json")
        if sc is None:
            continue
        g = sc.get
        over, peaks = g("tokens_per_s_over_autocast") or {}, g("peak_bytes") or {}
        cut = f", CUT after: {sc['partial']}" if "partial" in sc else ""
        lines.append(f"scheduler costs, {mode} ({g('device')}, {sc['model']['layers']}x d{sc['model']['d_model']}, {g('elapsed_s')} s{cut}): "
                     f"plan {g('plan')}, window {g('window_format')}")
        lines.append(f"  planned step / by hand {_f(g('planned_over_by_hand'), '.3f')} (<= 1.03); tokens/s over autocast: scheduler {_f(over.get('scheduler'))}, "
                     f"by hand {_f(over.get('hand'))}; profiling step / plain {_f(g('profiling_over_plain'))} (<= 1.5)")
        lines.append(f"  search: {g('search_steps')} steps, extra {_f(g('search_extra_in_planned_steps'), '.1f')} planned steps (<= 10), "
                     f"slowest {_f(g('search_slowest_over_planned'), '.1f')}x (<= 3); Dynamo graphs {g('dynamo_graphs')}")
        lines.append(f"  bytes scheduler / by hand {_f(g('scheduler_over_hand_bytes'), '.3f')} (<= 1.02), left after close {g('bytes_left_after_close')}, "
                     f"graph tensors {g('graph_tensors')}; peak GiB: window {_gb(peaks.get('profiling'))}, search {_gb(peaks.get('search'))}, "
                     f"scheduler {_gb(peaks.get('scheduler'))}, by hand {_gb(peaks.get('hand'))}, autocast {_gb(peaks.get('autocast'))}")
        lines.extend(_where_time_goes(sc))
    plan = load("search_plan.json")
    if plan is not None:
        p = plan["plan"]
        counts: dict = {}
        for layer in p.get("layers", {}).values():
            counts[layer.get("format")] = counts.get(layer.get("format"), 0) + 1
        measured = p.get("measured", {})
        refs = measured.get("references", {})
        lines.append(f"searched plan (gpt_gpu.toml): {counts}; measured {_f(1e3 * measured['seconds'] if 'seconds' in measured else None, '.1f')} ms a step, "
                     f"predicted {_f(1e3 * p['predicted']['seconds'] if 'seconds' in p.get('predicted', {}) else None, '.1f')}; references (ms): "
                     + ", ".join(f"{k} {_f(1e3 * v['seconds'] if v.get('seconds') else None, '.1f')}" for k, v in refs.items()))
    for name in ("plan_training_eager.json", "plan_training_compiled.json", "fp8_training_compiled.json"):
        pt = load(name)
        if pt is None:
            continue
        if "partial" in pt:
            lines.append(f"{name[:-5]} ({pt['compile'] or 'eager'}, {pt['elapsed_s']} s): CUT after: {pt['partial']}; first steps (s) {pt.get('first_steps_s')}")
            continue
        over, peak, held = pt["tokens_per_s_over_autocast"], pt.get("peak_over_autocast") or {}, pt["held_out_loss_increase_over_autocast"]
        lines.append(f"{name[:-5]} ({pt['compile'] or 'eager'}, {pt['elapsed_s']} s): " + "; ".join(
            f"{k} {_f(over[k])}x tok/s, {_f(peak.get(k))}x peak, held-out {_f(100 * held[k], '+.2f')} %" for k in over))
        lines.append(f"  plan {pt['plan']}; first steps (s, compile included) {pt['first_steps_s']}; Dynamo graphs {pt['dynamo_graphs']}")
        lines.extend(_where_time_goes(pt))
    for path in sorted(folder.glob("fsdp2_one_rank_*.json")):  # part (f), when asked for
        fs = json.loads(path.read_text())
        lines.append(f"{path.stem} ({fs['device']}, torch {fs['torch']}, {fs['world']} rank(s), size {fs['size']}):")
        lines.extend(f"  {r['kind']} {r['how']}: plan {r['plan']}, planned from step {r['first_planned_step']}, step {_f(1e3 * r['planned_step_s'] if r['planned_step_s'] else None, '.1f')} ms, "
                     f"search extra {_f(r['search_extra_planned_steps'], '.1f')} planned steps / slowest {_f(r['slowest_search_step_x_planned'], '.1f')}x, "
                     f"peak CUDA {_f(r['peak_cuda_mib'], '.0f')} MiB, FP8-gathered weights {r['fp8_gathered_weights']}, final loss {_f(r['final_loss'], '.4f')}"
                     for r in fs["runs"])
    return lines


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "stamp":
        stamp(Path(argv[1]), Path(argv[2]))
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        print("\n".join(summary(Path(argv[1]))))
        return 0
    print(__doc__.strip().splitlines()[2], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
