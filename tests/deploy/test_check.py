"""deploy/check.py and `python -m deploy`: a serve config checked before Ray starts, in seconds, with one line per
problem; and `python -m deploy serve` refusing to start on such a config, or while another start holds its port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig

from adapter_helpers import make_adapter
from deploy import preflight
from deploy.check import ConfigProblem, check_file
from ray_nodes import free_ports


def write_config(path: Path, port: int = 8000, **args) -> Path:
    path.write_text(yaml.safe_dump({"http_options": {"port": port}, "applications": [
        {"name": "lora", "route_prefix": "/", "import_path": "deploy.app:build_app", "args": args}]}))
    return path


@pytest.fixture
def demo_args(demo_dir) -> dict:
    return {"base_model": str(Path(demo_dir) / "base"), "adapter_roots": [str(Path(demo_dir) / "adapters")],
            "build_demo": False, "device": "cpu"}


def problems(path: Path) -> str:
    with pytest.raises(ConfigProblem) as e:
        check_file(path)
    return str(e.value)


def test_the_demo_config_passes(tmp_path, demo_args):
    [args] = check_file(write_config(tmp_path / "ok.yaml", **demo_args))
    assert args.base_model == demo_args["base_model"]


def test_an_unknown_arg_is_named_with_the_closest_valid_one(tmp_path, demo_args):
    found = problems(write_config(tmp_path / "bad.yaml", **demo_args, max_ranks=8))
    assert "args.max_ranks: unknown field; did you mean 'max_rank'?" in found


def test_a_wrong_value_is_named_with_its_field(tmp_path, demo_args):
    assert "args.max_rank:" in problems(write_config(tmp_path / "bad.yaml", **demo_args, max_rank=0))


def test_a_missing_base_model_folder_is_named_not_blamed_on_the_hub(tmp_path, demo_args):
    found = problems(write_config(tmp_path / "bad.yaml", **{**demo_args, "base_model": str(tmp_path / "Qwen2-typo")}))
    assert f"base_model '{tmp_path / 'Qwen2-typo'}': no such directory" in found and "Repo id" not in found


def test_a_folder_that_is_not_a_model_and_an_unsupported_architecture(tmp_path, demo_args):
    (tmp_path / "empty").mkdir()
    found = problems(write_config(tmp_path / "bad.yaml", **{**demo_args, "base_model": str(tmp_path / "empty")}))
    assert "not a transformers model folder (no config.json)" in found
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    found = problems(write_config(tmp_path / "bad.yaml", **{**demo_args, "base_model": str(tmp_path / "bert")}))
    assert "bert" in found.lower() and "not served" in found


def test_fp8_on_a_cpu_device_is_refused_before_ray_starts(tmp_path, demo_args):
    found = problems(write_config(tmp_path / "bad.yaml", **demo_args, quantization="fp8"))
    assert "quantization: fp8 needs a CUDA GPU with FP8 tensor cores; device: cpu has no FP8 GEMM" in found
    assert "args.quantization:" in problems(write_config(tmp_path / "bad.yaml", **demo_args, quantization="int4"))


def test_a_tensor_parallel_size_that_cannot_shard_the_base_is_refused_by_name(tmp_path, demo_args):
    found = problems(write_config(tmp_path / "bad.yaml", **demo_args, tensor_parallel_size=3))
    assert "tensor_parallel_size 3 does not divide the 4 attention heads" in found
    check_file(write_config(tmp_path / "good.yaml", **demo_args, tensor_parallel_size=2))


def test_adapters_that_a_replica_would_refuse_are_named_with_the_reason(tmp_path, demo_args):
    root = tmp_path / "adapters"
    make_adapter(root / "wide", base=AutoConfig.from_pretrained(demo_args["base_model"]), r=32, lora_alpha=32)
    args = {**demo_args, "adapter_roots": [str(root)], "max_rank": 16}
    found = problems(write_config(tmp_path / "discover.yaml", **args))  # adapters: discover
    assert "adapter 'wide':" in found and "rank 32 > max_rank 16" in found
    found = problems(write_config(tmp_path / "listed.yaml", **{**args, "max_rank": 32,
                                                               "adapters": {"ghost": str(root / "ghost")}}))
    assert "adapter 'ghost':" in found
    assert "adapter_roots: " in problems(write_config(tmp_path / "roots.yaml",
                                                      **{**args, "adapter_roots": [str(tmp_path / "nowhere")]}))


def test_the_command_exits_1_within_seconds_and_never_imports_ray(tmp_path, demo_args):
    config = write_config(tmp_path / "bad.yaml", **demo_args, max_ranks=8)
    probe = ("import runpy, sys; sys.argv = ['deploy', 'check', sys.argv[1]]\n"
             "try:\n    runpy.run_module('deploy', run_name='__main__')\n"
             "except SystemExit as e:\n    assert 'ray' not in sys.modules, 'ray was imported'; raise")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", probe, str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - start < 30, result.stderr
    assert "did you mean 'max_rank'?" in result.stderr and "ray was imported" not in result.stderr


def test_serve_refuses_a_bad_config_before_ray_starts(tmp_path, demo_args):
    [port] = free_ports(1)
    config = write_config(tmp_path / "bad.yaml", port, **{**demo_args, "base_model": str(tmp_path / "missing")})
    result = subprocess.run([sys.executable, "-m", "deploy", "serve", str(config)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "0"})
    assert result.returncode == 1 and "no such directory" in result.stderr, result.stderr
    assert "Started a local Ray instance" not in result.stderr


def test_a_second_start_on_the_same_port_stops_at_once_naming_the_first(tmp_path, demo_args):
    """Two `make serve` at once: the first holds the start's lock for its life, so the second cannot also pass
    the port check (both would, before either binds) and fail 30 s later inside Ray."""
    [port] = free_ports(1)
    config = write_config(tmp_path / "ok.yaml", port, **demo_args)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from deploy import preflight\n"
                               f"assert preflight.hold_start_lock({port}) is not None; print('held', flush=True)\n"
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "deploy", "serve", str(config)], capture_output=True,
                                text=True, timeout=60, env={**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "0"})
        assert second.returncode == 1 and time.monotonic() - start < 30, second.stderr
        assert f"another start of an app on :{port} (pid {holder.pid})" in second.stderr
    finally:
        holder.kill()
        holder.wait()
    assert preflight.hold_start_lock(port) is not None  # the lock went with the process that held it
