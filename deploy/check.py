"""A serve config checked before Ray starts: what `serve run` would otherwise find only inside the cluster, after
seconds, as a traceback that Serve repeats while it retries the build.

For each application built by deploy.app:build_app: every arg (an unknown one with the closest valid name),
the base model (a readable transformers folder of a supported architecture) and each local adapter (readable,
a LoRA the base can serve, within max_rank). Remote adapters are checked by the replicas when they start: the
check makes no network call.

    python -m deploy check serve_config.yaml     # exit 0, or 1 with one line per problem
"""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from pydantic import ValidationError
from transformers import AutoConfig, PretrainedConfig

from app.adapters.registry import AdapterRegistry
from app.adapters.uris import is_remote
from app.errors import ServingError
from app.model.architectures import UnsupportedModel, check_supported
from app.model.fp8_checkpoint import fp8_scheme
from deploy.args import AppArgs, discover_local

BUILD_APP = "deploy.app:build_app"


class ConfigProblem(ValueError):
    """What is wrong with a serve config, one line per problem."""


def check_file(path: Path) -> list[AppArgs]:
    """The args of each of the file's applications that this project builds; ConfigProblem otherwise."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigProblem(f"{path}: cannot be read as YAML ({e})") from None
    applications = [app for app in config.get("applications") or [] if app.get("import_path") == BUILD_APP]
    if not applications:
        raise ConfigProblem(f"{path}: no application with import_path {BUILD_APP}")
    checked, problems = [], []
    for app in applications:
        where = f"{path}: application {app.get('name', '?')!r}"
        try:
            args = parse_args(app.get("args") or {})
            if not args.uses_demo:  # built, with its adapters, on first use
                base_config = check_base_model(args)
                problems += [f"{where}: {problem}" for problem in adapter_problems(args, base_config)]
            checked.append(args)
        except (ConfigProblem, UnsupportedModel) as e:
            problems += [f"{where}: {line}" for line in str(e).splitlines()]
    if problems:
        raise ConfigProblem("\n".join(problems))
    return checked


def parse_args(values: dict) -> AppArgs:
    try:
        return AppArgs.model_validate(values)
    except ValidationError as e:
        raise ConfigProblem("\n".join(_arg_problem(error) for error in e.errors())) from None


def _arg_problem(error: dict) -> str:
    field = ".".join(str(part) for part in error["loc"]) or "args"
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(field, AppArgs.model_fields, n=1)
        return f"args.{field}: unknown field" + (f"; did you mean {close[0]!r}?" if close else "")
    return f"args.{field}: {error['msg'].removeprefix('Value error, ')}"


def check_base_model(args: AppArgs) -> PretrainedConfig:
    """The config of a readable transformers folder of a supported architecture."""
    folder = Path(args.base_model).expanduser()
    if not folder.is_dir():
        raise ConfigProblem(f"base_model {args.base_model!r}: no such directory")
    if not (folder / "config.json").is_file():
        raise ConfigProblem(f"base_model {args.base_model!r}: not a transformers model folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigProblem(f"base_model {args.base_model!r}: its config.json cannot be read ({e})") from None
    check_supported(config)  # UnsupportedModel, naming the model type
    fp8 = "quantization: fp8" if args.quantization == "fp8" else "its FP8 checkpoint" if fp8_scheme(config)[0] else None
    if fp8 and args.device == "cpu":
        raise ConfigProblem(f"base_model {args.base_model!r}: {fp8} needs a CUDA GPU with FP8 tensor cores; "
                            "device: cpu has no FP8 GEMM")
    if args.tensor_parallel_size > 1:
        # The engine's worker module brings the model runner and torch.distributed (seconds of imports), which a
        # config that does not shard never needs: Serve imports this module in a new process for every deploy.
        from app.engine.workers import check_tensor_parallel_config

        check_tensor_parallel_config(args.engine_config(), config)
    return config


def adapter_problems(args: AppArgs, base_config: PretrainedConfig) -> list[str]:
    """Why each local adapter the app starts with would be refused."""
    local_roots = [root for root in args.adapter_roots if not is_remote(root)]
    missing = [root for root in local_roots if not Path(root).expanduser().is_dir()]
    if missing:
        return [f"adapter_roots: {root!r}: no such directory" for root in missing]
    if not local_roots:
        return []  # remote adapters are read by the replicas
    if args.adapters == "discover":
        adapters = {}
        for root in reversed(local_roots):  # the first root's wins, as when the app starts
            adapters.update(discover_local(root))
    else:  # a name alone may be under a remote root: those are the replicas' to check
        only_local = len(local_roots) == len(args.adapter_roots)
        adapters = {name: path for name, path in args.adapters.items()
                    if not is_remote(path) and (only_local or Path(path).is_absolute())}
    registry = AdapterRegistry(local_roots, base_config, args.max_rank, args.max_adapter_bytes, args.target_modules)
    problems = []
    for name, path in adapters.items():
        try:
            registry.validate(name, path)
        except (ServingError, OSError, ValueError) as e:
            problems.append(f"adapter {name!r}: {e}")
    registry.shutdown()
    return problems
