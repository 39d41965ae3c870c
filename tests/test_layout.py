"""The package's import graph has no cycle: each module can be read after the ones it imports."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import grpo

PACKAGE = Path(grpo.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The grpo modules `path` imports, at the top or inside functions (a package's own __init__ is not counted
    for its submodules: Python runs it first anyway)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    own = module_name(path)
    return {m for m in found if m != own and not own.startswith(m + ".")}


def test_no_import_cycles():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports(p, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


# TRL hands the trainer to a user's rollout_func (`rollout_func(prompts, trainer)`): grpo.agents.make_rollout
# passes it on. Nothing else receives the trainer whole.
TRAINER_TAKERS = {"make_rollout"}


def test_no_function_takes_the_trainer_whole():
    # Issue 39: a helper takes what it reads (the loop's state, a Stateful part, a callable), so renaming a trainer
    # field cannot break a module that only a resume runs. Two checks: no function of grpo/training/ has a
    # parameter named `trainer`, and the trainer's own methods never pass `self` to a function.
    training = PACKAGE / "training"
    named, passed = [], []
    for path in training.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "trainer" for a in args):
                    named.append(f"{path.name}:{node.lineno} {node.name}")
            if path.name in ("trainer.py", "trl_surface.py") and isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                values = [*node.args, *(k.value for k in node.keywords)]
                builtin = isinstance(node.func, ast.Name) and hasattr(builtins, callee)  # (getattr(self, ...))
                if callee not in TRAINER_TAKERS and not builtin and any(isinstance(v, ast.Name) and v.id == "self"
                                                                        for v in values):
                    passed.append(f"{path.name}:{node.lineno} {callee}(self)")
    assert not named and not passed, named + passed


def test_declared_interfaces_are_implemented():
    # Issue 39: the engine's and the source's shapes are declared once (Protocols), and every implementation has
    # every member, so the trainer calls them without probing (no getattr on an engine).
    import inspect

    from grpo.engines.base import CAPABILITIES, RolloutEngine, ScriptedGenerator, as_engine
    from grpo.engines.cpu import CPUBackend, CPUSampler
    from grpo.engines.policy import TransformersBackend, UpdateBackend
    from grpo.engines.sampling import TransformersSampler
    from grpo.engines.sharding import WholeWeightsSampler
    from grpo.engines.vllm import VLLMEngine
    from grpo.engines.vllm_server import VLLMServerClient
    from grpo.training.rollout.pipeline import LaggedRollouts
    from grpo.training.rollout.pipeline_server import ServerRollouts
    from grpo.training.rollout.sources import RolloutSource, SyncRollouts

    def members(protocol) -> set[str]:
        return {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("__")}

    assert members(RolloutEngine) == {"generate", *CAPABILITIES}
    for engine in (TransformersSampler, CPUSampler, WholeWeightsSampler, VLLMEngine, VLLMServerClient,
                   ScriptedGenerator):
        assert members(RolloutEngine) <= set(dir(engine)), engine
    for backend in (TransformersBackend, CPUBackend):
        assert members(UpdateBackend) | {"name"} <= set(dir(backend)), backend
    for source in (SyncRollouts, LaggedRollouts, ServerRollouts):
        assert members(RolloutSource) <= set(dir(source)), source  # (and `layout`, set in each __init__)

    class Plain:  # a user's engine with generate alone, and one capability of its own
        loaded = None

        def generate(self, prompt_ids, params, seeds):
            return ("generated", len(prompt_ids))

        def update_weights(self, model):
            self.loaded = model

    plain = Plain()
    engine = as_engine(plain)
    assert engine.generate_together([[1], [2]], None, [0, 1]) == ("generated", 2)  # its own rows
    engine.update_weights("weights")
    assert plain.loaded == "weights" and engine.loaded == "weights"  # its own capability, and attributes
    assert engine.sleep() is None and engine.wake() is None
    assert as_engine(ScriptedGenerator(lambda p, g: [], [0])).__class__ is ScriptedGenerator


# Who may import the training loop's package from outside it: the package's front door (`grpo.GRPOTrainer`, lazily)
# and the command line. Everything else (core, engines, rewards, agents, config, tasks) sits below training, so an
# import of grpo.training from there would be an arrow back up.
TRAINING_CALLERS = {"grpo", "grpo.cli",
                    "grpo.config.reference"}  # (the docs generator: docs/from_trl.md lists the metrics' names)


def test_no_arrow_back_up_into_training():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    up = {m: sorted(i for i in imports(p, set(paths)) if i == "grpo.training" or i.startswith("grpo.training."))
          for m, p in paths.items() if not m.startswith("grpo.training") and m not in TRAINING_CALLERS}
    assert not {m: i for m, i in up.items() if i}, up


def test_training_is_in_wings():
    # grpo/training/ holds the loop (trainer.py, trl_surface.py) and one folder per stage, nothing else flat.
    training = PACKAGE / "training"
    flat = {p.name for p in training.glob("*.py")} - {"__init__.py", "trainer.py", "trl_surface.py"}
    assert not flat, f"modules directly under grpo/training/ (put each in its stage's folder): {sorted(flat)}"
    wings = {p.name for p in training.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert wings == {"checkpoint", "data", "evaluation", "observe", "rollout", "run", "setup", "update"}, wings


def test_files_and_functions_stay_readable():
    # Issue 39: no module of grpo/ over 450 lines; no function over 80 (its docstring aside) but the LM head's
    # documented kernels.
    kernels = {"hidden_loss", "forward"}  # grpo/engines/head/loss.py: one autograd Function's passes, documented
    long_files, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 450:
            long_files.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                    getattr(node.body[0], "value", None), ast.Constant) else None
                length -= 0 if doc is None else doc.end_lineno - doc.lineno + 1
                head = "engines/head/" in str(path) and node.name in kernels
                if length > 80 and not head:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name} {length}")
    assert not long_files and not long_functions, long_files + long_functions


def test_the_tests_map_names_every_test_file():
    # tests/README.md tells a reader which files test a package; a new file that it does not name (by its name or
    # by a `prefix*.py` pattern there) fails here, so the map stays whole.
    import fnmatch
    import re

    here = Path(__file__).parent
    text = (here / "README.md").read_text()
    patterns = set(re.findall(r"`([\w*]+\.py)`", text))
    missing = [p.name for p in sorted(here.glob("test_*.py"))
               if not any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)]
    assert not missing, f"tests/README.md does not name {missing}"
