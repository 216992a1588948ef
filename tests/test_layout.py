"""What the package layout promises: imports point down the pipeline, never back up; no module
grows past what one concern holds; artifacts saved before the layout changed still load and
resume (the files in tests/data/before_layout were written by the code of before; see
tests/data/before_layout/README.md)."""

import ast
from pathlib import Path

import pytest
import torch

import autoprec as ap
from autoprec.workloads import default_workload

BEFORE = Path(__file__).parent / "data" / "before_layout"
PACKAGE = Path(ap.__file__).parent

# The parts, bottom first (docs/development.md, "Architecture and import rules"): a module may import its own part and
# the parts of its layer or below, never one above. Imports under ``if TYPE_CHECKING:`` are
# annotations only and do not count.
LAYERS = (
    {"_version", "errors", "_checks", "formats", "device", "_io", "_tracing", "_generators", "calls", "coverage", "blocks", "plan", "changes", "saved_bytes", "device_clock", "noise", "opcount",
     "workload", "cpu_load", "layer_precision", "replica"},
    {"runtime"},
    {"profiling", "scaling"},
    {"sensitivity", "costs"},
    {"search"},
    {"monitoring"},
    {"distributed", "comm"},
    {"scheduler"},
    {"job", "integrations", "bench", "workloads", "cli", "__main__", "autoprec"},
)
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
MAX_LINES = 700


def part_of(module: str) -> str:
    """``autoprec.search.pipeline`` -> ``search``; the package itself -> ``autoprec``."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "autoprec"


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        names = list(relative.parts)
        is_package = names[-1] == "__init__"
        if is_package:
            names = names[:-1]
        yield path, ".".join(names), is_package


def imports(path: Path, module: str, is_package: bool):
    """(line, imported module) of each runtime import of an autoprec module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                yield node.lineno, target
            elif node.module and node.module.split(".")[0] == "autoprec":
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "autoprec")


def test_every_part_has_a_layer_and_imports_only_its_layer_and_below():
    wrong = []
    for path, module, is_package in modules():
        part = part_of(module)
        assert part in LAYER_OF, f"{module}: part {part!r} has no layer; place it in LAYERS (and docs/development.md's layout)"
        for line, target in imports(path, module, is_package):
            above = part_of(target)
            if LAYER_OF.get(above, -1) > LAYER_OF[part]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {part} imports {target} ({above} is above it)")
    assert not wrong, "imports pointing up the pipeline:\n" + "\n".join(wrong)


def test_the_import_check_sees_an_import_up_the_pipeline(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ..scheduler import DynamicPrecisionScheduler\nif TYPE_CHECKING:\n    from ..job import run_job\n", encoding="utf-8")
    found = list(imports(bad, "autoprec.runtime.bad", False))
    assert found == [(1, "autoprec.scheduler")]  # the TYPE_CHECKING one is left out
    assert LAYER_OF[part_of(found[0][1])] > LAYER_OF["runtime"]


def import_time_edges():
    """module -> the autoprec modules it imports when it is imported (module level, outside
    ``if TYPE_CHECKING:``); ``from package import submodule`` is an edge to the submodule."""
    known = {module for _, module, _ in modules()}
    edges = {}
    for path, module, is_package in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = set()
        for node in tree.body:  # module level only: an import inside a function runs on its call
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom):
                base = module.split(".") if is_package else module.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level else (node.module or "")
                subs = {f"{target}.{a.name}" for a in node.names} & known
                targets |= subs if len(subs) == len(node.names) else subs | ({target} & known)
        edges[module] = targets - {module}
    return edges


def test_no_import_circle_but_type_only_ones():
    """Every module imports at load time only modules that do not import it back, however
    indirectly (a type-only import under ``if TYPE_CHECKING:`` is how two modules name each
    other's types)."""
    edges = import_time_edges()
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_the_circle_check_sees_a_circle_through_a_package():
    edges = import_time_edges()
    assert "autoprec.plan" in edges["autoprec"]  # the package re-exports Plan: a version read back from it would close a circle
    assert edges["autoprec.plan"] & {"autoprec._version"} and "autoprec" not in edges["autoprec.plan"]


def test_no_module_is_longer_than_one_concern_needs():
    long = {str(path.relative_to(PACKAGE.parent)): n for path, _, _ in modules() if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by concern"


TESTS = Path(__file__).parent


def test_tests_mirror_the_packages_and_reach_shared_helpers_only_through_support():
    """Each test folder is named for a part of the package (or a cross-cutting suite: bad input,
    real models), and no test file imports another test file: shared helpers live in `support`."""
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders - parts <= {"bad_input", "models"}, f"test folders that mirror no package: {sorted(folders - parts - {'bad_input', 'models'})}"
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("importorskip", "import_module"):
                names += [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]  # a skip would hide it
            offenders += [f"{path.relative_to(TESTS)} imports {n}" for n in names if n.split(".")[0].startswith("test_") or n.split(".")[0] == "conftest"]
    assert not offenders, f"{offenders}: move what they share into tests/support"


SETTINGS = dict(monitor_window=6, monitor_steps=6, sample_every=2, memory_budget=0.85, accuracy_budget=0.05,
                formats=("fp32", "bf16", "int8"), measure_costs=False)


RESUMED_STEPS = 65  # the saved search's off-path work left (device peaks, the upstream term's forwards, the FP32 pairs' bytes too), its integer programs' 8 steps (`in_run.SOLVE_STEPS`), planned steps


@pytest.mark.parametrize("saved", ["scheduler_searching.pt", "scheduler_planned.pt"])
def test_a_scheduler_state_saved_before_resumes_and_trains(saved):
    checkpoint = torch.load(BEFORE / saved, weights_only=True)
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(1)
    model.load_state_dict(checkpoint["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = ap.DynamicPrecisionScheduler(model, **SETTINGS)
    scheduler.load_state_dict(checkpoint["scheduler"])
    sampler = wl.train_batches(5)
    for _ in range(RESUMED_STEPS):
        with scheduler.precision_context():
            loss = wl.loss(model, sampler.next())
        scheduler.backward(loss)
        assert scheduler.step(opt)
        opt.zero_grad(set_to_none=True)
    assert scheduler.phase == "planned" and torch.isfinite(loss)
    assert scheduler.step_count == checkpoint["scheduler"]["step"] + RESUMED_STEPS


def test_a_plan_and_a_profile_saved_before_load_equal_to_themselves_resaved(tmp_path):
    plan = ap.Plan.load(BEFORE / "plan.json")
    plan.save(tmp_path / "plan.json")
    assert ap.Plan.load(tmp_path / "plan.json") == plan
    assert plan.format_counts() and all(lp.reason for lp in plan.layers.values())
    from autoprec.profiling import Profile

    profile = Profile.load(BEFORE / "profile.json")
    assert set(profile.layers) == set(plan.layers) and profile.steps == 2
