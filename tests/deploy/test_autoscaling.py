"""Load-driven autoscaling of LoRAReplica with our router, on the local cluster the deploy tests share.

Serve's autoscaler counts, per deployment, the requests running on replicas and the requests still
queued in each caller's router (Serve wraps every `choose_replicas` wait in `wrap_queued_request`,
ray/serve/_private/router.py, and reports that gauge to the controller). Requests waiting in
AdapterAffinityRouter are exactly those, so the default request-based policy sees them and no
custom policy is needed; the test measures it: at one replica that accepts 4 requests at once, the
controller's total reaches well past 4 while 12 clients wait.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import ray
import yaml
from ray import serve
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from deploy.args import AppArgs
from traffic import Traffic, demo_adapters, expected_texts, replica_view, wait_for

# Serve warns when look_back_period_s is below its deprecated metrics_interval_s (10 s): the test's short
# window is deliberate, the metrics it averages are pushed every 0.5 s here (conftest.FAST_METRICS).
pytestmark = pytest.mark.filterwarnings("ignore:.*look_back_period_s.*:FutureWarning")
CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"
CLUSTER_ARGS = None  # the `autoscaled` fixture deploys
BATCH = 4  # max_batch_size and max_ongoing_requests of the test replicas
# serve_config.yaml's block with small delays (and a target of one full batch, as there).
TEST_DELAYS = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "upscale_delay_s": 1.0,
               "downscale_delay_s": 2.0, "look_back_period_s": 2.0}


def commented_autoscaling_block() -> dict:
    """The `autoscaling_config` that serve_config.yaml shows, commented, for LoRAReplica."""
    text = CONFIG.read_text()
    block = re.search(r"^(\s*)# autoscaling_config:\n((?:\1#  .*\n)+)", text, re.M)
    assert block, "serve_config.yaml has no commented autoscaling_config block"
    lines = [line.split("#", 1)[1][1:] for line in block.group(0).splitlines()]
    return yaml.safe_load("\n".join(lines))["autoscaling_config"]


def test_serve_config_autoscaling_block_is_valid_and_fits_the_replica():
    config = commented_autoscaling_block()
    AutoscalingConfig(**config)
    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    args = AppArgs(**app["args"])
    max_ongoing = args.max_ongoing_requests or 2 * args.max_batch_size
    # Scale before replicas are full: past the target, requests queue in the engine, then in the router.
    assert config["target_ongoing_requests"] == args.max_batch_size < max_ongoing
    assert config["min_replicas"] >= 1  # scaling to zero would make the first request wait for a replica


@pytest.fixture(scope="module")
def autoscaled(cluster, demo_dir):
    """The app with autoscaling on, one replica to start; yields the HTTP url."""
    args = {"base_model": f"{demo_dir}/base", "adapter_roots": [f"{demo_dir}/adapters"], "build_demo": False,
            "device": "cpu", "num_slots": 6, "max_batch_size": BATCH, "max_ongoing_requests": BATCH,
            "max_input_tokens": 256, "max_total_tokens": 4096, "spread_after_s": 0.2}
    autoscaling = {**commented_autoscaling_block(), **TEST_DELAYS, "target_ongoing_requests": BATCH}
    cluster.client.deploy_apps(ServeDeploySchema.model_validate({"applications": [{
        "name": "lora", "route_prefix": "/", "import_path": "deploy.app:build_app", "args": args,
        "deployments": [{"name": "LoRAReplica", "autoscaling_config": autoscaling},
                        {"name": "Ingress", "num_replicas": 1}]}]}), _blocking=True)
    wait_for(lambda: len(replica_view(cluster.url)) == 1, 120, what="one replica reporting")
    return cluster.url


def replicas_running() -> int:
    deployment = serve.status().applications["lora"].deployments["LoRAReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def total_requests_seen_by_autoscaler() -> float:
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return ray.get(controller._get_total_num_requests_for_deployment_for_testing.remote(
        DeploymentID(name="LoRAReplica", app_name="lora")), timeout=10)


def test_load_scales_up_the_router_follows_and_idle_scales_down(autoscaled, demo_dir):
    url = autoscaled
    expected = expected_texts(demo_dir, demo_adapters(demo_dir))
    (first,) = replica_view(url)
    started = time.monotonic()
    seen_totals = []
    with Traffic(url, expected, clients=12) as heavy:
        def scaled_up():
            seen_totals.append(total_requests_seen_by_autoscaler())
            view = replica_view(url)
            return len(view) == 2 and next(uid for uid in view if uid != first)

        new = wait_for(scaled_up, 120, poll_s=0.25, what="a second replica added by the autoscaler")
        scaled_up_at = time.monotonic()
        # The router sends the new replica requests and, while both are full, hints for them.
        wait_for(lambda: any(o.replica == new for o in heavy.results if o.started > scaled_up_at)
                 and replica_view(url)[new]["arrivals"]["hints_received"] > 0, 60,
                 what="requests and hints reaching the new replica")
        hints_at_new = replica_view(url)[new]["arrivals"]["hints_received"]
    # A trickle of traffic continues while Serve scales back down: nothing may fail as a replica leaves.
    with Traffic(url, expected, clients=1) as light:
        wait_for(lambda: replicas_running() == 1, 120, what="Serve scaling back to one replica")
        scaled_down_at = time.monotonic()
        remaining = wait_for(lambda: len(view := replica_view(url)) == 1 and next(iter(view)), 30,
                             what="the router's view dropping the removed replica")
        wait_for(lambda: sum(o.started > scaled_down_at + 1 for o in light.results) >= 5, 30,
                 what="requests after the scale-down")
    late = [o for o in light.results if o.started > scaled_down_at + 1]
    results = heavy.results + light.results
    print(f"autoscaler saw up to {max(seen_totals):.1f} requests at 1 replica (max_ongoing_requests {BATCH}); "
          f"scaled up {scaled_up_at - started:.1f}s into the load, down {scaled_down_at - scaled_up_at:.1f}s "
          f"later; {len(results)} requests, {hints_at_new} hints at the new replica")
    assert max(seen_totals) > 1.5 * BATCH, f"the autoscaler never counted router-queued requests: {seen_totals}"
    failed = [o for o in results if not o.ok]
    assert not failed, [(o.model, o.stream, o.status, o.detail) for o in failed[:5]]
    assert {o.model for o in results} >= set(expected) and any(o.stream for o in results)
    assert {o.replica for o in late} == {remaining}
