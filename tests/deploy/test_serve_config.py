"""serve_config.yaml, which `make serve` runs, validates against the app's arguments."""

from pathlib import Path

import yaml

from deploy.args import AppArgs

CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"


def test_serve_config_args_validate_and_build_an_engine_config():
    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    args = AppArgs(**app["args"])
    config = args.engine_config()
    assert config.max_batch_size == app["args"]["max_batch_size"]
