"""The package's import graph has no cycle: each module can be read after the ones it imports."""

from __future__ import annotations

import ast
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
                if callee not in TRAINER_TAKERS and any(isinstance(v, ast.Name) and v.id == "self" for v in values):
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
