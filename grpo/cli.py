"""The `grpo` command: train, eval, plot.

    grpo train [RECIPE.yaml] [key=value ...]     train; no recipe means the default recipe
    grpo train [RECIPE.yaml] [key=value ...] --help-config   the resolved config as YAML, each key's meaning, and
                                                            the values that differ from grpo's and TRL's defaults
    grpo eval --model PATH --task NAME [--n N] [--k K] [--json FILE]
    grpo plot RUN_DIR
    grpo vllm-serve --model PATH [--port 8000] [--tensor-parallel-size N] ...   a vLLM server (vllm_mode: server)

A bad config or bad data ends in one line naming the key, the function or the row, and exit status 2.
"""

from __future__ import annotations

import os
import signal
import sys

STOPS = ("SIGINT", "SIGTERM", "SIGUSR1")  # (SIGUSR1: SLURM's --signal warning; its default action is to die)


def _stop_name(number: int) -> str:
    return "interrupted" if number == signal.SIGINT else f"stopped: {signal.Signals(number).name}"


def _exit_now(number: int, frame) -> None:
    """A stop signal while the libraries import: one line and out. Unwinding a half-done `import torch` can crash
    the interpreter (a segfault, exit -11), and nothing has been written yet."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"grpo: {_stop_name(number)} before anything was written.\n".encode())
    os._exit(130 if number == signal.SIGINT else 75)


def _on_stops(handler) -> None:
    """Install `handler` for the stop signals (not those the parent set to be ignored; main() keeps the previous
    ones)."""
    for name in STOPS:
        number = getattr(signal, name)
        if signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, handler)


if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "grpo":  # the command: from its first import on,
    _on_stops(_exit_now)  # a stop signal is one line (before, SIGTERM killed it silently, SIGINT gave a traceback)

import argparse  # noqa: E402 - after the handlers: the command's imports take 50 ms
import json  # noqa: E402
from pathlib import Path  # noqa: E402

DEFAULT_RECIPE = Path(__file__).parent / "recipes" / "default.yaml"


def _parser() -> argparse.ArgumentParser:
    from grpo.config.base import SHIPPED_MODELS
    from grpo.tasks import TASKS

    parser = argparse.ArgumentParser(prog="grpo", description="Train language models with Group Relative Policy "
                                     "Optimization (GRPO).", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run `grpo COMMAND --help` for each command's options.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (default: the shipped tiny model on arithmetic)",
                           description="Train with GRPO. RECIPE is a YAML file of config keys; key=value pairs "
                           "override it (values are YAML: beta=0, report_to=[]). Without RECIPE the default "
                           f"recipe ({DEFAULT_RECIPE.name}) is used, with the overrides applied.")
    train.add_argument("args", nargs="*", metavar="RECIPE|key=value")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.add_argument("--help-config", action="store_true", help="print the resolved config (RECIPE and the "
                       "overrides applied) as YAML with each key's meaning, marking values that differ from grpo's "
                       "and TRL's defaults, and exit")
    train.add_argument("--print-config", action="store_true", help="the same, without the meanings")

    ev = sub.add_parser("eval", help="score a model on a task's held-out split or a dataset",
                        description="Accuracy, format rate, pass@k, maj@k and mean length over k samples.")
    ev.add_argument("--model", required=True, help="model directory, a run directory (its final/ is used), or a "
                    f"model shipped in the package: {', '.join(SHIPPED_MODELS)}")
    ev.add_argument("--task", default=None, help=f"built-in task whose held-out split is scored: {', '.join(TASKS)} "
                    "(default arithmetic)")
    ev.add_argument("--dataset", default=None, help="a data file or save_to_disk directory instead of a task")
    ev.add_argument("--reward-funcs", nargs="+", default=None, help="rewards for --dataset; the first is accuracy")
    ev.add_argument("--tools", nargs="+", default=None, help="tools the model may call (default: the task's), e.g. "
                    "calculator; the samples are then multi-turn conversations")
    ev.add_argument("--n", type=int, default=500, help="number of held-out problems (default 500)")
    ev.add_argument("--k", type=int, default=1, help="samples per problem (default 1)")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0; 0: greedy)")
    ev.add_argument("--max-completion-length", type=int, default=128, help="tokens per sample (default 128)")
    ev.add_argument("--difficulty", type=int, default=None, help="task difficulty (default: the task's)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the problems and of sampling (default 0)")
    ev.add_argument("--json", default=None, help="also write the result (with every completion) to this file")

    plot = sub.add_parser("plot", help="draw reward and accuracy against step for a run directory")
    plot.add_argument("run_dir")

    serve = sub.add_parser("vllm-serve", help="serve rollouts from vLLM to trainers with vllm_mode: server",
                           description="Start a vLLM engine that trainer processes send prompts to and push the "
                           "policy's weights into (grpo/engines/vllm_server.py). Needs vLLM.")
    serve.add_argument("--model", required=True, help="the model the trainers train (directory or hub name)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to shard the model over")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the device's memory vLLM may take (default 0.9: the server has it alone)")
    serve.add_argument("--dtype", default="auto", help="weights dtype (default: the model's)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    serve.add_argument("--set", dest="engine_kwargs", action="append", default=[], metavar="KEY=VALUE",
                       help="a further vllm.LLM keyword argument, value as YAML (e.g. enforce_eager=true)")
    return parser


class Stopped(KeyboardInterrupt):
    """A stop signal while the trainer is being built (model, data, engine): unwound like Ctrl-C, then one line."""

    def __init__(self, number: int):
        super().__init__(number)
        self.number = number


def _raise_stop(number: int, frame) -> None:
    raise Stopped(number)


def main(argv: list[str] | None = None) -> int:
    """`grpo ...`. As the command itself (argv None), a stop signal from the first instant ends in one line: while
    the libraries import, at once (exit 130 for SIGINT, 75 otherwise); while the trainer is built, unwound (the same
    codes); during training, after the step, with a checkpoint (grpo.training.run.signals)."""
    previous = {getattr(signal, name): signal.getsignal(getattr(signal, name)) for name in STOPS}
    if argv is None:
        _on_stops(_exit_now)
    try:
        return _main(argv)
    finally:
        if argv is not None:  # (a caller's main([...]): its handlers back; the command keeps what _run set)
            for number, handler in previous.items():
                signal.signal(number, handler)


def _main(argv: list[str] | None) -> int:
    from grpo.config import ConfigError

    args = _parse(_parser(), argv)
    _quiet_libraries()
    try:
        if args.command == "train":
            return _train(args, argv)
        if args.command == "eval":
            return _eval(args)
        if args.command == "vllm-serve":
            return _serve(args)
        return _plot(args.run_dir)
    except ConfigError as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        return 2
    except _reward_errors() as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        return 2


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, with `grpo train`'s flags and its RECIPE and key=value items in any order (argparse alone
    stops the items at the first flag: `--resume max_steps=9` was "unrecognized arguments")."""
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.args += [item for item in extra if not item.startswith("-")]
        extra = [item for item in extra if item.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _quiet_libraries() -> None:
    """Loading bars of transformers and datasets would interleave with the live display."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _reward_errors() -> tuple[type, ...]:
    from grpo.rewards import RewardError

    return (RewardError,)


def _train(args, argv: list[str] | None) -> int:
    from grpo.config import GRPOConfig
    from grpo.training.run.errors import EXIT_INTERRUPTED, set_resume_command

    recipe = None
    overrides = []
    for item in args.args:
        if "=" in item:
            overrides.append(item)
        elif recipe is None:
            recipe = item
        else:
            print(f"grpo: error: two recipes given ({recipe}, {item}); give one, then key=value overrides.",
                  file=sys.stderr)
            return 2
    if args.resume:
        overrides.append("resume=true")
    cfg = GRPOConfig.load(recipe or DEFAULT_RECIPE, overrides)
    if args.help_config or args.print_config:
        from grpo.config.show import resolved_yaml

        given = [a if len(a) <= 60 else a[:57] + "..." for a in args.args] or ["(the default recipe)"]
        sys.stdout.write(resolved_yaml(cfg, explain=args.help_config, title=" ".join(["grpo train", *given])))
        return 0
    set_resume_command(resume_command(argv))
    import grpo.training.trainer  # noqa: F401 - the heavy imports, while a stop signal still exits at once

    _on_stops(_raise_stop)  # (from here a stop signal unwinds: files being written are cleaned up)
    try:
        return _run(cfg, owns_process=argv is None)  # (argv None: the `grpo` command itself, not a caller's main())
    except KeyboardInterrupt as err:  # a stop signal before training started, or a second Ctrl-C during it
        from grpo.training.checkpoint.files import complete_checkpoints
        from grpo.training.run.errors import EXIT_RESUMABLE, resume_hint

        number = err.number if isinstance(err, Stopped) else signal.SIGINT
        found = complete_checkpoints(cfg.output_dir)
        _say(f"grpo: {_stop_name(number)}: the newest checkpoint is {found[-1][1]}; resume: {resume_hint()}" if found
             else f"grpo: {_stop_name(number)}: no checkpoint was written, nothing to resume.")
        return EXIT_INTERRUPTED if number == signal.SIGINT else EXIT_RESUMABLE


def _run(cfg, owns_process: bool) -> int:
    from grpo.training.trainer import GRPOTrainer, TrainingStopped

    if not torch_has_gpu():
        # This command owns its process: tune glibc's malloc for the CPU engine's training steps (process-wide, so
        # the library leaves it to its caller: grpo.engines.cpu.native.keep_freed_memory).
        from grpo.engines.cpu import native

        native.keep_freed_memory()
    try:
        trainer = GRPOTrainer(args=cfg)
        trainer.train()
    except TrainingStopped as err:  # (a write that fails at the start, e.g. the on-disk reference weights, too)
        _say(f"grpo: stopped: {err}")
        return err.exit_code
    if owns_process:
        # The run is complete. A stop signal from here to the exit has nothing left to stop: ignored, it cannot kill
        # this process with its default action (SIGTERM) or an uncaught KeyboardInterrupt (SIGINT) while another
        # process of the launch still writes final/ (its launcher would then end that one too).
        for name in cfg.stop_signals:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    return 0


def _say(line: str) -> None:
    """One line on stderr, from the main process only (every process of a launch ends the same way)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def resume_command(argv: list[str] | None) -> list[str]:
    """The command line that started this run: `grpo train ...` (argv as main() got it), or under a launcher
    (torchrun, accelerate launch: its workers are its children) the launcher's own command line."""
    if argv is not None:
        return ["grpo", *argv]
    if "LOCAL_RANK" in os.environ:
        try:
            parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            parent = []
        if len(parent) > 1 and Path(parent[0]).name.startswith("python") and Path(parent[1]).name in (
                "accelerate", "torchrun"):
            parent = [Path(parent[1]).name, *parent[2:]]
        if "grpo.cli" in parent or any(Path(p).name == "grpo" for p in parent):
            return parent
    first = Path(sys.argv[0]).name
    return ["grpo", *sys.argv[1:]] if first == "grpo" else [sys.executable, "-m", "grpo.cli", *sys.argv[1:]]


def torch_has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _eval(args) -> int:
    import torch

    from grpo.agents import AgentRollout, make_agent_spec
    from grpo.config import ConfigError, GRPOConfig
    from grpo.config.base import shipped_model
    from grpo.engines.base import SamplingParams
    from grpo.engines.select import choose_engine, make_sampler
    from grpo.training.evaluation.held_out import evaluate_prompts
    from grpo.rewards import RewardRunner, resolve_reward
    from grpo.training.data.prompts import build_prompt_set, load_dataset_any
    from grpo.training.setup.model import load_tokenizer
    from grpo.training.setup.inputs import check_vocabulary
    from grpo.training.setup.threads import set_threads

    _check_eval_args(args)
    model_path = Path(shipped_model(args.model))
    if (model_path / "final" / "config.json").exists():
        model_path = model_path / "final"
    if not (model_path / "config.json").exists():
        raise ConfigError(f"--model: {args.model!r} is neither a model directory nor a run directory with final/.")
    if args.dataset:
        if not args.reward_funcs:
            raise ConfigError("--reward-funcs: --dataset needs reward functions (the first one is the accuracy).")
        cfg = GRPOConfig(model_name_or_path=str(model_path), task=None, dataset_name=args.dataset,
                         max_prompt_length=None, tools=args.tools or [])
        dataset = load_dataset_any(args.dataset, "test", key="--dataset")
        dataset = dataset.select(range(min(args.n, len(dataset))))
        specs, weights, prefill = args.reward_funcs, None, ""
    else:
        from grpo.tasks import get_task

        try:
            task = get_task(args.task or "arithmetic")
        except ValueError as err:
            raise ConfigError(f"--task: {err}") from None
        cfg = GRPOConfig(model_name_or_path=str(model_path), task=task.name, max_prompt_length=None,
                         tools=args.tools or list(task.tools))
        level = {} if args.difficulty is None else {"difficulty": args.difficulty}
        dataset = task.dataset("test", n=args.n, seed=args.seed, **level)
        specs, weights, prefill = task.reward_funcs, task.reward_weights, task.prefill
    funcs = [resolve_reward(s) for s in specs]
    runner = RewardRunner(funcs, weights, on_error="zero")
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grpo.training.data.vision import image_processing_for

    agents = make_agent_spec(cfg)  # (the tools' worker processes start before the model loads)
    tokenizer = load_tokenizer(str(model_path))
    images = image_processing_for(cfg, None, tokenizer)  # (a vision-language model: its image processor)
    prompts = build_prompt_set(dataset, tokenizer, cfg, prefill, "--dataset", agents=agents, images=images)
    auto = AutoModelForCausalLM if images is None else AutoModelForImageTextToText
    model = auto.from_pretrained(str(model_path), dtype=torch.float32).eval()
    check_vocabulary(tokenizer, model.config, str(model_path), [p for p in prompts.prompt_ids if p])
    set_threads(None, model)  # (as training's default: grpo.training.setup.threads)
    torch.manual_seed(args.seed)
    gen = make_sampler(choose_engine("auto", model, torch.device("cpu"), 1, "NO"), model, tokenizer)
    agent = agents and AgentRollout(agents, gen, tokenizer, prompts.render, args.max_completion_length)
    params = SamplingParams(args.max_completion_length, args.temperature)
    result = evaluate_prompts(gen, tokenizer, prompts, runner, [n for n, _ in funcs], params,
                              seed=args.seed, k=args.k, agent=agent)
    _print_table(str(model_path), result)
    if args.json:  # (its missing directories made, as output_dir's are)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": str(model_path), **result}, indent=1))
    return 0


def _plot(run_dir: str) -> int:
    from grpo.config import ConfigError
    from grpo.training.observe.plot import plot_run

    try:
        print(plot_run(run_dir))
    except (FileNotFoundError, ValueError) as err:  # (no metrics.jsonl there, or nothing in it to plot)
        raise ConfigError(str(err)) from None
    except OSError as err:  # (plot.png cannot be written there)
        raise ConfigError(f"plot: cannot write {err.filename or run_dir} ({err.strerror}); make it writable.") from None
    return 0


def _check_eval_args(args) -> None:
    """The numbers and the --json path, before anything loads (ConfigError naming the flag)."""
    from grpo.config import ConfigError

    for flag, value in (("--n", args.n), ("--k", args.k), ("--max-completion-length", args.max_completion_length)):
        if value < 1:
            raise ConfigError(f"{flag}: must be >= 1 (got {value}).")
    if args.temperature < 0:
        raise ConfigError(f"--temperature: must be >= 0 (0: greedy; got {args.temperature}).")
    if args.json:
        path = Path(args.json)
        existing = next(p for p in path.absolute().parents if p.exists())
        if path.is_dir() or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            why = "it is a directory" if path.is_dir() else f"{existing} is not a writable directory"
            raise ConfigError(f"--json: cannot write {args.json} ({why}); give a file path in a directory you can "
                              "write to.")


def _serve(args) -> int:
    from grpo.config import ConfigError, parse_override
    from grpo.engines.vllm import VLLMUnavailable
    from grpo.engines.vllm_server import serve

    extra = dict(parse_override(item) for item in args.engine_kwargs)
    try:
        serve(args.model, args.host, args.port, tensor_parallel_size=args.tensor_parallel_size,
              gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype, max_model_len=args.max_model_len,
              **extra)
    except VLLMUnavailable as err:
        raise ConfigError(f"vllm-serve: {err}") from None
    return 0


def _print_table(model: str, result: dict) -> None:
    print(f"model: {model}")
    for key, value in result.items():
        if isinstance(value, float):
            print(f"  {key:<14} {value:.4f}" if key != "num_prompts" else f"  {key:<14} {int(value)}")


def command() -> None:
    """The `grpo` command (and `python -m grpo.cli`): main(), then out at once. Exit handlers run (worker pools, the
    reference weights' file, trackers), then the process ends without tearing down torch, transformers and
    DeepSpeed module by module, which took 2-5 s after the last line (docs/runs.md)."""
    import atexit

    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    command()
