"""``pushkv bench --sweep``'s command line and the plan it makes (lengths x rates)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from connector.tools.bench.single import SINGLE
from connector.tools.bench.stacks import CONFIGS
from connector.tools.bench.sweep_points import SweepPlan
from connector.tools.bench.sweep_setup import KV_ROOM_REQUESTS, WARMUP_PROMPTS
from connector.tools.tinymodel import MODELS

# The ideal and the fair comparison first: if --max-minutes runs out, what is left for a
# resumed run is vLLM's busy-polling default configurations.
DEFAULT_CONFIGS = (
    SINGLE,
    "push",
    "vllm-pull-noprog",
    "vllm-push-noprog",
    "vllm-pull",
    "vllm-push",
)
# --smoke: the 1 x 2 sweep CI runs (tests/e2e/test_sweep_smoke.py); one length, for CI's time
# (two rates: the test checks that each point's traces are its own).
SMOKE_LENGTHS: tuple[int, ...] = (256,)
SMOKE_RATES: tuple[float, ...] = (2.0, 4.0)
SMOKE_CONFIGS: tuple[str, ...] = (SINGLE, "push")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pushkv bench --sweep",
        description="Input length x open-loop request rate (Poisson arrivals), per "
        "configuration, against one plain vLLM instance: results, TTFT decompositions and "
        "figures in one run folder (docs/benchmarks.md).",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="1 x 2 points (256 tokens, 2 and 4 req/s), single and push, "
        "12 prompts a point, model tiny: the CI check",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        choices=[SINGLE, *CONFIGS],
        default=None,
        help=f"in this order (default: {' '.join(DEFAULT_CONFIGS)})",
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"{' or '.join(MODELS)} (built locally) or a model directory (default: tiny-kv, "
        "32 KiB of KV per token)",
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=None,
        metavar="TOKENS",
        help="default 128 512 2048",
    )
    p.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="default 0.5 1 2 4",
    )
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--point-s",
        type=float,
        default=None,
        help="seconds of arrivals per point: a point sends rate x this many prompts "
        "(default 8; clamped to --min-prompts and --max-prompts)",
    )
    p.add_argument("--min-prompts", type=int, default=6)
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="vllm bench serve's cap on requests in flight (a safety net; open loop below it)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"each server's KV cache (default: room for {KV_ROOM_REQUESTS} requests of the "
        "longest length, at least 256 MiB)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the servers' dtype; auto: bfloat16 on a GPU or a CPU with native bf16 "
        "(avx512_bf16 or AMX), float32 on other CPUs (AVX2 only: vLLM's bf16 path computes "
        "there at a few GFLOP/s, `python -m bench.cpu_dtype`)",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="more vLLM flags for every server, one string (e.g. on a GPU host)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{WARMUP_PROMPTS} closed-loop requests of the longest length on each stack "
        "before its points (default: on, off with --smoke)",
    )
    p.add_argument("--pin-servers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--gpus",
        nargs=2,
        default=None,
        metavar=("P", "D"),
        help="on a GPU host, P's and D's CUDA_VISIBLE_DEVICES (e.g. 0 1, or 0,1 2,3 for TP2); "
        "single runs on P's (default: every server sees every GPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start every configuration's stack at once and run each point on all of them "
        "back to back (the order reversed at every other point), so configurations are "
        "compared minutes apart at most: for A/B runs of small differences",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=30.0,
        help="the whole sweep's bound: a point that would not end in time is left for a "
        "resumed run (--run-dir of this one)",
    )
    p.add_argument(
        "--rerender",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run nothing: recompute each point's TTFT decomposition from its traces (this "
        "commit's critical-path model), then rewrite RUN_DIR's sweep.json, report and figures",
    )
    p.add_argument(
        "--rounds",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="run nothing: read these sweeps (same plan) as rounds and print, per point, "
        "each configuration's median and range over them, and its TTFT against the single "
        "instance's and each traced configuration against its -notrace twin, paired per "
        "round and request by request (connector/tools/bench/sweep_rounds.py; to "
        "--rounds-out too)",
    )
    p.add_argument("--rounds-out", type=Path, default=None, metavar="FILE")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="default runs/sweep-<timestamp>/; an existing sweep's folder resumes it "
        "(points whose results file says ok are skipped)",
    )
    return p.parse_args(list(argv))


def make_plan(args: argparse.Namespace) -> SweepPlan:
    lengths = args.lengths or (SMOKE_LENGTHS if args.smoke else (128, 512, 2048))
    # The rates reach P's saturation at the longest length on tiny-kv, the shorter lengths
    # stay below theirs (docs/benchmarks.md, "Why these rates"; `python -m bench.cpu_dtype`).
    rates = args.rates or (SMOKE_RATES if args.smoke else (0.5, 1.0, 2.0, 4.0))
    return SweepPlan(
        tuple(lengths),
        tuple(rates),
        output_len=args.output_len,
        point_s=args.point_s or (3.0 if args.smoke else 8.0),
        min_prompts=12 if args.smoke else args.min_prompts,
        max_prompts=args.max_prompts,
        cap=args.max_concurrency,
        seed=args.seed,
    )
