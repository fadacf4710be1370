"""`serve run serve_config.yaml` entry point: one typed build_app that binds the deployments."""


import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import DeploymentActorConfig, RequestRouterConfig
from deploy.args import DEMO_DIR, GRACE_S, AppArgs
from deploy.check import check_base_model
from deploy.ingress import Ingress
from deploy.replica import LoRAReplica
from deploy.router import AdapterAffinityRouter
from deploy.state import REPLICA_DEPLOYMENT, STATE_ACTOR, RouterState

# Serve runs user code, and a caller's request router, on event loops of their own threads by
# default: every request, routing decision and streamed chunk then crosses threads (and the GIL)
# twice more per hop. One loop per replica process is the latency-optimized setting of Serve
# (what RAY_SERVE_THROUGHPUT_OPTIMIZED turns on). Our handlers leave file reads and engine work
# to threads, so they do not hold the shared loop.
# How often a stopping replica looks whether its calls have ended (Serve's default, 2 s, is added to every stop).
STOP_POLL_S = 0.25
SINGLE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def ensure_assets(args: AppArgs) -> None:
    """The built-in demo is generated on first use, so a fresh machine needs no other step."""
    if args.uses_demo:
        from app.demo.build import ensure_demo

        ensure_demo(DEMO_DIR)


def replica_options(args: AppArgs) -> dict:
    """All options of the LoRA replica deployment, from one place."""
    has_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    wants_gpu = args.device.startswith("cuda") or (args.device == "auto" and has_gpu)
    options = {
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": args.max_ongoing_requests or 2 * args.max_batch_size,
        # A tensor-parallel replica holds its GPUs as one bundle: Ray makes them its CUDA_VISIBLE_DEVICES, and its
        # engine's workers (app/engine/workers.py) take cuda:1 onwards.
        "ray_actor_options": {**({"num_gpus": args.tensor_parallel_size, "num_cpus": args.tensor_parallel_size}
                                 if wants_gpu else {"num_cpus": 0.5 * args.tensor_parallel_size}),
                              "runtime_env": {"env_vars": SINGLE_LOOP_ENV}},
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": GRACE_S,
        "graceful_shutdown_wait_loop_s": STOP_POLL_S,
        "deployment_actors": [DeploymentActorConfig(
            name=STATE_ACTOR, actor_class=ray.remote(RouterState), init_kwargs={"adapters": args.initial_adapters()},
            actor_options={"num_cpus": 0})],
    }
    if args.router == "adapter_affinity":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=AdapterAffinityRouter,
            request_router_kwargs={"spread_after_s": args.spread_after_s, "hints": args.hints,
                                   "hint_depth": args.hint_depth},
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=2.0,
            # A pending request re-checks its replica often: a freed batch row should not sit idle
            # for Serve's default 0.5 s backoff.
            initial_backoff_s=0.005, backoff_multiplier=1.5, max_backoff_s=0.05)
    return options


def build_app(args: AppArgs) -> Application:
    return make_app(args)


def make_app(args: AppArgs, **replica_overrides) -> Application:
    ensure_assets(args)
    check_base_model(args)  # before any replica starts: Serve would retry one that refuses it for good
    replicas = serve.deployment(LoRAReplica).options(**{**replica_options(args), **replica_overrides})
    ingress = serve.deployment(Ingress).options(
        name="Ingress", ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": SINGLE_LOOP_ENV}},
        max_ongoing_requests=1000, graceful_shutdown_wait_loop_s=STOP_POLL_S)
    return ingress.bind(replicas.bind(args.model_dump()), args.model_dump())
