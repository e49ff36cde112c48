"""``python -m simulator``: plan one deployment (text table, or one JSON object with ``--json``)::

    python -m simulator --nodes 8 [--gpus-per-node 8] [--mode normal|low-latency|both] [--tokens T]
        [--ll-tokens T] [--hidden H] [--topk K] [--experts E] [--redundant-experts N]
        [--dispatch-dtype fp8|bf16] [--gpu h800|h100|h200|b200] [--nic cx7|cx6|cx8|eth200|nvlink-p2p] [--num-sms S]
        [--routing uniform|group-limited|zipf:A|trace:FILE] [--seed S] [--json] [--plot FILE.png]
        [--sweep-nodes 1,2,4,8,16] [--preset v3-ep64|h200-ep2|decode-ep32] [--kernels deepep|deep_ep]

Check the model against the published DeepEP rows and the H200 measurements, or predict deep_ep's own kernels::

    python -m simulator validate [--json] [--set normal-h800,ll-h800,...]
    python -m simulator predict [--json] [--calibration FILE.json]

Exit status: 0 on success; 2 on bad arguments (the message names the argument, the rule and the value);
``validate`` exits 1 when a row is outside its tolerance or the mean error exceeds 5 %.
"""
from __future__ import annotations

import argparse
import sys

from simulator import hardware, scenario, validate


def _node_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep-nodes must be a comma-separated list of ints, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--sweep-nodes needs node counts >= 1, got {text!r}")
    return values


def plan_parser() -> argparse.ArgumentParser:
    d = scenario.Scenario()
    p = argparse.ArgumentParser(prog="python -m simulator",
                                description="Capacity planner for deep_ep dispatch/combine (SimPy model). "
                                            "'python -m simulator validate' checks it against published rows.")
    p.add_argument("--preset", choices=sorted(scenario.PRESETS), default=None,
                   help="start from a named scenario; other flags override its fields")
    p.add_argument("--nodes", type=int, default=d.nodes, help="number of nodes (NVLink domains)")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node, help="GPUs per node (default 8)")
    p.add_argument("--mode", choices=scenario.MODES, default=d.mode, help="kernels to simulate (default both)")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens per rank (default {scenario.DEFAULT_NORMAL_TOKENS} normal, "
                        f"{scenario.DEFAULT_LL_TOKENS} low-latency)")
    p.add_argument("--ll-tokens", type=int, default=None, help="tokens per rank for low-latency mode only")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (default 7168)")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=d.experts, help="routed (logical) experts (default 256)")
    p.add_argument("--redundant-experts", type=int, default=None,
                   help="EPLB replicas of the hottest experts (default: the fewest that make the expert count "
                        "divisible by the EP size)")
    p.add_argument("--dispatch-dtype", choices=scenario.DTYPES, default=d.dispatch_dtype)
    p.add_argument("--kernels", choices=scenario.KERNELS, default=d.kernels,
                   help="kernel family: deepep (DeepEP V1's kernels, validated on published rows; default) or "
                        "deep_ep (ours, calibrated on simulator/data; python -m simulator.calibrate "
                        "--from-bench)")
    p.add_argument("--gpu", choices=sorted(hardware.GPUS), default=d.gpu)
    p.add_argument("--nic", choices=sorted(hardware.NICS), default=d.nic)
    p.add_argument("--num-sms", type=int, default=d.num_sms, help="SMs of the normal kernels (default 24)")
    p.add_argument("--routing", default=d.routing, help="uniform | group-limited | zipf:A | trace:FILE "
                                                        "(default group-limited: at most 4 nodes per token)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write latency/bandwidth vs nodes (matplotlib)")
    p.add_argument("--sweep-nodes", type=_node_list, default=None, metavar="1,2,4,...",
                   help="simulate each node count instead of --nodes")
    return p


def validate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator validate",
                                description="Predict every published DeepEP row and the H200 measurements; print "
                                            "predicted, measured and error per row.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--set", default=None, help="comma-separated row sets (default all: normal-h800, ll-h800, "
                                               "ll-rdma-h800, h200, h200-sweep)")
    return p


def run_validate(argv: list[str]) -> int:
    args = validate_parser().parse_args(argv)
    rows = validate.all_rows()
    if args.set:
        wanted = set(args.set.split(","))
        known = {r.set_name for r in rows}
        if not wanted <= known:
            validate_parser().error(f"--set must name sets from {sorted(known)}, got {sorted(wanted - known)}")
        rows = [r for r in rows if r.set_name in wanted]
    outcomes = validate.validate(rows)
    print(validate.to_json(outcomes) if args.json else validate.to_text(outcomes), end="" if not args.json else "\n")
    return 0 if validate.passed(outcomes) else 1


_PRESET_FIELDS = ("nodes", "gpus_per_node", "mode", "tokens", "ll_tokens", "hidden", "topk", "experts",
                  "redundant_experts", "dispatch_dtype", "gpu", "nic", "num_sms", "routing", "seed", "kernels")


def run_plan(argv: list[str]) -> int:
    parser = plan_parser()
    args = parser.parse_args(argv)
    if args.preset:  # the preset's fields become the defaults, so explicit flags still win
        preset = scenario.PRESETS[args.preset]
        parser.set_defaults(**{f: getattr(preset, f) for f in _PRESET_FIELDS})
        args = parser.parse_args(argv)
    try:
        sc = scenario.Scenario(nodes=args.nodes if args.sweep_nodes is None else args.sweep_nodes[0],
                               gpus_per_node=args.gpus_per_node, mode=args.mode, tokens=args.tokens,
                               ll_tokens=args.ll_tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                               dispatch_dtype=args.dispatch_dtype, gpu=args.gpu, nic=args.nic, num_sms=args.num_sms,
                               routing=args.routing, seed=args.seed, redundant_experts=args.redundant_experts,
                               kernels=args.kernels)
        report = scenario.run_sweep(sc, args.sweep_nodes) if args.sweep_nodes else scenario.run(sc)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    if args.plot:
        report.plot(args.plot)
    print(report.to_json() if args.json else report.to_text(), end="\n" if args.json else "")
    return 0


def run_predict(argv: list[str]) -> int:
    from simulator import predictions
    parser = argparse.ArgumentParser(prog="python -m simulator predict",
                                     description="Predictions for deep_ep's kernels on H200 (intranode EP2/4/8, "
                                                 "low-latency EP2/4/8, internode on 2 virtual nodes x 1/2/4 GPUs), "
                                                 "to be checked by measurement.")
    parser.add_argument("--calibration", default=None, metavar="FILE.json",
                        help="deep_ep calibration to use (default simulator/data/calibration_deep_ep.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    try:
        rows = predictions.predict(args.calibration)
    except ValueError as exc:
        parser.error(str(exc))
    print(predictions.to_json(rows, args.calibration) if args.json else predictions.to_markdown(rows),
          end="\n" if args.json else "")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "validate":
        return run_validate(argv[1:])
    if argv and argv[0] == "predict":
        return run_predict(argv[1:])
    return run_plan(argv)


if __name__ == "__main__":
    sys.exit(main())
