"""The package's layers run downhill (style.md, section 3), checked on the import graph with Python's `ast`.

Floors, from the ground up; a module may import its own floor's modules (without cycles) and the floors below,
plus the exceptions named in ALLOWED:

    ground    config, names, quant
    kernels   nanoflash.kernels.*          the Triton fast paths (never the model: the model's math is passed in)
    model     model
    algo      grpo, checkpoint             GRPO's math; HF checkpoints
    engine    nanoflash.parallel.*         PP / EP / DP, never GRPO, the SGLang side, the CLI or the loop
    sglang    nanoflash.sglang.*           the SGLang boundary: client, buckets, layout, transports, push, probe
    server    nanoflash.server.*           nanoflash's own SGLang-protocol server (never the trainer or the loop)
    loop      nanoflash.rl.*               the loop's two halves, data, rewards, metrics, hooks
    top       cli, export                  the command lines

Also: nothing in the package imports `instruments`, `experiments`, `bench` or `tests`; `train.py` imports no
instrument or experiment (they attach through `--train.hooks`); no nanoflash module is imported inside a
function except the model's optional fast paths (nanoflash.model -> nanoflash.kernels); no import cycle.
The training half (`rl.trainer`) knows nothing of SGLang's storage (no `nanoflash.sglang` / `server` import).

The bug each check catches: an upward import (the engine importing the CLI, the kernels the model), a hidden
import inside a function, a cycle, an instrument called by name from the loop. The planted-import test below
shows the checker failing on each.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLOORS = [("ground", ("nanoflash.config", "nanoflash.names", "nanoflash.quant", "nanoflash")),
          ("kernels", ("nanoflash.kernels",)), ("model", ("nanoflash.model",)),
          ("algo", ("nanoflash.grpo", "nanoflash.checkpoint")), ("engine", ("nanoflash.parallel",)),
          ("sglang", ("nanoflash.sglang",)), ("server", ("nanoflash.server",)), ("loop", ("nanoflash.rl",)),
          ("top", ("nanoflash.cli", "nanoflash.export"))]
# module prefix -> prefixes it must never import even though they sit below it
FORBIDDEN = {"nanoflash.rl.trainer": ("nanoflash.sglang", "nanoflash.server"),
             "nanoflash.server": ("nanoflash.parallel",),
             "nanoflash.sglang": ("nanoflash.server",)}
OUTSIDE = ("instruments", "experiments", "bench", "tests")
LAZY_OK = {("nanoflash.model", "nanoflash.kernels")}   # the model's optional fast paths


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(mod: str) -> int:
    best = (-1, -1)   # (prefix length, floor index): the longest matching prefix wins
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if mod == p or mod.startswith(p + "."):
                best = max(best, (len(p), i))
    return best[1]


def imports(source: str, mod: str) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import in `source` of module `mod`."""
    tree, out = ast.parse(source), []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, in_fn, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:   # relative: resolve against the package
                    pkg = mod.split(".")[: len(mod.split(".")) - child.level + (1 if mod.endswith("__init__") else 0)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in child.names:   # `from pkg import submodule` imports the submodule
                    sub = f"{base}.{a.name}"
                    out.append((sub if (ROOT / (sub.replace(".", "/") + ".py")).exists()
                                or (ROOT / sub.replace(".", "/")).is_dir() else base, in_fn, child.lineno))
            visit(child, fn)
    visit(tree, False)
    return out


def violations(files: dict[str, str]) -> list[str]:
    """Every broken rule in {module: source}, one line each."""
    bad, graph = [], {}
    for mod, src in files.items():
        graph[mod] = set()
        for target, in_fn, line in imports(src, mod):
            root = target.split(".")[0]
            if root in OUTSIDE:
                bad.append(f"{mod}:{line} imports {target} (outside the package)")
                continue
            if root != "nanoflash":
                continue
            if in_fn and not any(mod == a and target.startswith(b) for a, b in LAZY_OK):
                bad.append(f"{mod}:{line} imports {target} inside a function")
            if floor(target) > floor(mod):
                bad.append(f"{mod}:{line} imports {target} uphill ({FLOORS[floor(mod)][0]} -> "
                           f"{FLOORS[floor(target)][0]})")
            for prefix, banned in FORBIDDEN.items():
                if (mod == prefix or mod.startswith(prefix + ".")) and target.startswith(banned):
                    bad.append(f"{mod}:{line} imports {target} (forbidden for {prefix})")
            if target in files and target != mod:
                graph[mod].add(target)
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return bad


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def package_files() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted((ROOT / "nanoflash").rglob("*.py"))}


def test_package_layers_run_downhill():
    bad = violations(package_files())
    assert not bad, "\n".join(bad)


def test_train_py_imports_no_instrument_or_experiment():
    bad = [t for t, _, _ in imports((ROOT / "train.py").read_text(), "train")
           if t.split(".")[0] in OUTSIDE]
    assert not bad, f"train.py imports {bad}: instruments attach through --train.hooks"


@pytest.mark.parametrize("mod,line,expect", [
    ("nanoflash.parallel.planner", "from nanoflash.cli import parse_args", "uphill"),
    ("nanoflash.kernels.moe", "from nanoflash.model import swiglu", "uphill"),
    ("nanoflash.rl.trainer", "from nanoflash.sglang.layout import sglang_fp8", "forbidden"),
    ("nanoflash.rl.collector", "from instruments import live", "outside the package"),
    ("nanoflash.sglang.push", "def f():\n    from nanoflash.parallel import dims", "inside a function"),
    ("nanoflash.names", "import nanoflash.quant", "import cycle"),
])
def test_checker_fails_on_a_planted_import(mod, line, expect):
    """Each rule seen to fire: a planted import appended to a real module is reported."""
    files = package_files()
    files[mod] = files[mod] + "\n" + line + "\n"
    bad = violations(files)
    assert any(expect in b for b in bad), bad
