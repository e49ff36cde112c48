"""``python -m simulator``: plan one deployment of deep_ep's kernels (text tables, or one JSON object with ``--json``).

    python -m simulator --nodes 8                    # this library's kernels (--kernels deep_ep, the default)
    python -m simulator --nodes 8 --compare deepep   # side by side with DeepEP V1's kernels, ratio per op
    python -m simulator --sweep-nodes 1,2,4,8 --plot plan.png
    python -m simulator validate [--json] [--set normal-h800,...]   # the model against published rows
    python -m simulator predict [--json] [--calibration FILE.json]  # deep_ep's kernels on H200, to be measured

``python -m simulator --help`` lists every flag and preset. Exit status: 0 on success; 2 on bad arguments, with one
line on stderr naming the argument, the rule and the value; 1 when the plot cannot be written, and for ``validate``
when a row is outside its tolerance or the mean error exceeds 5 %.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace

from simulator import calibrate, hardware, scenario, validate
from simulator.report import KERNEL_FAMILIES, Comparison, Report

# The family ``python -m simulator`` plans for unless --kernels says otherwise.
DEFAULT_KERNELS = "deep_ep"

PRESET_HELP = {
    "v3-ep64": "DeepSeek-V3 on 8 nodes x 8 H800 + CX7 (EP64), both modes: DeepEP's published configuration",
    "h200-ep2": "one machine of 2 x H200 over NVLink (EP2), uniform routing: the GPUs deep_ep is measured on",
    "decode-ep32": "decode on 4 nodes x 8 H800 (EP32): low-latency mode only, 128 tokens per rank",
}


class CliError(Exception):
    """A misuse of the command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _node_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sweep-nodes must be a comma-separated list of ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--sweep-nodes needs node counts >= 1, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--sweep-nodes lists a node count twice, got {text!r}")
    return values


def plan_parser() -> argparse.ArgumentParser:
    d = scenario.Scenario()
    presets = "\n".join(f"  {name:<12} {PRESET_HELP[name]}" for name in sorted(scenario.PRESETS))
    p = _Parser(
        prog="python -m simulator", formatter_class=argparse.RawDescriptionHelpFormatter,
        # Flags not given stay out of the namespace: presets and flag combinations need to know what was set.
        argument_default=argparse.SUPPRESS,
        description="Capacity planner for deep_ep's dispatch and combine (a SimPy model, no GPU needed): time per "
                    "op,\nbandwidth, the limiting resource, buffer sizes per GPU and the recommended num_sms, chunk "
                    "sizes\nand num_qps_per_rank, with the predicted time at that setting.\n\n"
                    "subcommands:\n"
                    "  validate     predict every published DeepEP row and the H200 measurements; print the error "
                    "per row\n               (python -m simulator validate --help)\n"
                    "  predict      predictions of deep_ep's kernels on H200 at EP2/4/8, to check by measurement\n"
                    "               (python -m simulator predict --help)",
        epilog=f"presets (--preset NAME; flags given with it override its fields):\n{presets}\n\n"
               "Errors are one line on stderr with exit status 2; docs/simulator.md is the guide.")
    p.add_argument("--preset", choices=sorted(scenario.PRESETS), help="start from a named scenario (listed below)")
    p.add_argument("--nodes", type=int, help=f"number of nodes, i.e. NVLink domains (default {d.nodes})")
    p.add_argument("--sweep-nodes", type=_node_list, metavar="1,2,4,...",
                   help="simulate each of these node counts instead of --nodes")
    p.add_argument("--gpus-per-node", type=int, help=f"GPUs per node (default {d.gpus_per_node})")
    p.add_argument("--mode", choices=scenario.MODES,
                   help=f"which kernels to simulate: normal (prefill/training), low-latency (decode) or both "
                        f"(default {d.mode})")
    p.add_argument("--tokens", type=int,
                   help=f"tokens per rank (default {scenario.DEFAULT_NORMAL_TOKENS} in normal mode, "
                        f"{scenario.DEFAULT_LL_TOKENS} in low-latency mode); with --mode both also the low-latency "
                        f"count, capped at {scenario.LL_MAX_TOKENS} (the low-latency kernels' limit)")
    p.add_argument("--ll-tokens", type=int,
                   help=f"tokens per rank of low-latency mode only (at most {scenario.LL_MAX_TOKENS})")
    p.add_argument("--hidden", type=int, help=f"hidden size, a multiple of 128 (default {d.hidden})")
    p.add_argument("--topk", type=int, help=f"experts per token (default {d.topk})")
    p.add_argument("--experts", type=int, help=f"routed (logical) experts (default {d.experts})")
    p.add_argument("--redundant-experts", type=int,
                   help="EPLB replicas of the hottest experts (default: the fewest that make the expert count "
                        "divisible by the EP size)")
    p.add_argument("--dispatch-dtype", choices=scenario.DTYPES,
                   help=f"dispatch payload: fp8 (e4m3 + per-128 scales) or bf16; combine is bf16 "
                        f"(default {d.dispatch_dtype})")
    p.add_argument("--kernels", choices=scenario.KERNELS,
                   help=f"kernel family: deep_ep ({KERNEL_FAMILIES['deep_ep']}, calibrated on its own "
                        f"measurements; default) or deepep ({KERNEL_FAMILIES['deepep']}, validated on DeepEP's "
                        f"published rows)")
    p.add_argument("--compare", nargs="?", const="", metavar="FAMILY",
                   help="also simulate another kernel family (default: the one --kernels does not name) and print "
                        "both side by side with the time ratio per op")
    p.add_argument("--gpu", choices=sorted(hardware.GPUS), help=f"GPU profile (default {d.gpu})")
    p.add_argument("--nic", choices=sorted(hardware.NICS),
                   help=f"scale-out NIC profile; nvlink-p2p is virtual nodes on one NVLink host (default {d.nic})")
    p.add_argument("--num-sms", type=int,
                   help=f"SMs of the normal-mode kernels, even (default {d.num_sms}); low-latency kernels use all")
    p.add_argument("--routing",
                   help="uniform | group-limited (at most 4 nodes per token) | zipf:A (skewed expert popularity) "
                        "| trace:FILE (a JSON topk_idx trace) (default group-limited)")
    p.add_argument("--seed", type=int, help=f"seed of every random draw (default {d.seed})")
    p.add_argument("--json", action="store_true", default=False, help="print one JSON object instead of the tables")
    p.add_argument("--plot", metavar="FILE",
                   help="also draw time and bandwidth against the node count of --sweep-nodes (two counts or "
                        "more) into FILE; the extension picks the format (.png, .svg, .pdf, ...); needs matplotlib")
    return p


def _check_plot(path: str) -> None:
    """Refuse a plot path that cannot be written, before simulating."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"--plot: folder {folder} does not exist, got {path!r}")
    if not os.access(folder, os.W_OK):
        raise CliError(f"--plot: folder {folder} is not writable, got {path!r}")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise CliError(f"--plot needs matplotlib ({exc})") from None
    formats = sorted(Figure().canvas.get_supported_filetypes())
    if ext not in formats:
        raise CliError(f"--plot: the extension picks the format, one of {', '.join('.' + f for f in formats)}; "
                       f"got {path!r}")


def _scenario_from(args: argparse.Namespace) -> scenario.Scenario:
    """The scenario of the parsed flags: the preset's fields (or the defaults), then every flag given."""
    given = vars(args)
    base = scenario.PRESETS[given["preset"]] if "preset" in given else scenario.Scenario()
    names = {f.name for f in fields(scenario.Scenario)}
    values = {name: given[name] for name in names if name in given}
    values.setdefault("kernels", DEFAULT_KERNELS)
    if "sweep_nodes" in given:
        values["nodes"] = given["sweep_nodes"][0]
    return replace(base, **values)


def _check_combinations(args: argparse.Namespace, sc: scenario.Scenario) -> None:
    given = vars(args)
    if "sweep_nodes" in given and "nodes" in given:
        raise CliError("--nodes and --sweep-nodes: give one (--sweep-nodes lists every node count to simulate)")
    if "ll_tokens" in given and sc.mode == "normal":
        raise CliError(f"--ll-tokens sets low-latency tokens, but --mode is normal; got --ll-tokens "
                       f"{given['ll_tokens']}")
    if "ll_tokens" in given and "tokens" in given and sc.mode == "low-latency":
        raise CliError("--tokens and --ll-tokens both set the low-latency tokens with --mode low-latency: give one")
    if "num_sms" in given and sc.mode == "low-latency":
        raise CliError(f"--num-sms sets the normal kernels' SMs, but --mode is low-latency (its kernels use every "
                       f"SM); got --num-sms {given['num_sms']}")
    if given.get("compare", "") not in ("",) + scenario.KERNELS:
        raise CliError(f"--compare must name a kernel family ({' or '.join(scenario.KERNELS)}), got "
                       f"{given['compare']!r}")
    if given.get("compare") == sc.kernels:
        raise CliError(f"--compare must name another kernel family than --kernels ({sc.kernels}), got "
                       f"{given['compare']}")
    if "plot" in given:
        if "compare" in given:
            raise CliError("--plot draws one kernel family: drop --compare, or plot each --kernels in turn")
        counts = given.get("sweep_nodes", [])
        if len(counts) < 2:
            raise CliError("--plot draws against the node count and needs --sweep-nodes with two counts or more "
                           "(e.g. --sweep-nodes 1,2,4,8)")
        _check_plot(given["plot"])


def _flag_message(message: str) -> str:
    """A Scenario message names its field (``ll_tokens must be ...``): name the flag instead."""
    for name in sorted((f.name for f in fields(scenario.Scenario)), key=len, reverse=True):
        if message.startswith(name + " must "):
            return "--" + name.replace("_", "-") + message[len(name):]
    return message


def _simulate(sc: scenario.Scenario, sweep: list[int] | None) -> Report:
    return scenario.run_sweep(sc, sweep) if sweep else scenario.run(sc)


def run_plan(argv: list[str]) -> int:
    parser = plan_parser()
    args = parser.parse_args(argv)
    given = vars(args)
    try:
        sc = _scenario_from(args)
        _check_combinations(args, sc)
        report = _simulate(sc, given.get("sweep_nodes"))
        result: Report | Comparison = report
        if "compare" in given:
            other = given["compare"] or next(k for k in scenario.KERNELS if k != sc.kernels)
            try:
                result = Comparison(report, _simulate(replace(sc, kernels=other), given.get("sweep_nodes")))
            except (ValueError, TypeError) as exc:
                raise CliError(f"--compare {other}: {exc}") from None
    except CliError as exc:
        parser.error(str(exc))
    except (ValueError, TypeError) as exc:
        parser.error(_flag_message(str(exc)))
    if "plot" in given:
        try:
            drew = report.plot(given["plot"])
        except (OSError, ValueError) as exc:
            parser.exit(1, f"{parser.prog}: error: --plot {given['plot']}: {exc}\n")
        print(f"wrote {given['plot']}: {drew}", file=sys.stderr)
    print(result.to_json() if args.json else result.to_text(), end="\n" if args.json else "")
    return 0


def validate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m simulator validate",
                description="Predict every published DeepEP row and the H200 measurements; print predicted, "
                            "measured and error per row. Exit status 1 when a row is outside its tolerance.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--set", default=None, help="comma-separated row sets (default all: normal-h800, ll-h800, "
                                               "ll-rdma-h800, h200, h200-sweep)")
    return p


def run_validate(argv: list[str]) -> int:
    parser = validate_parser()
    args = parser.parse_args(argv)
    rows = validate.all_rows()
    if args.set:
        wanted = set(args.set.split(","))
        known = {r.set_name for r in rows}
        if not wanted <= known:
            parser.error(f"--set must name sets from {sorted(known)}, got {sorted(wanted - known)}")
        rows = [r for r in rows if r.set_name in wanted]
    outcomes = validate.validate(rows)
    logo = calibrate.leave_one_group_out(sorted({r.group for r in rows}))
    print(validate.to_json(outcomes, logo) if args.json else validate.to_text(outcomes, logo),
          end="" if not args.json else "\n")
    return 0 if validate.passed(outcomes) else 1


def run_predict(argv: list[str]) -> int:
    from simulator import predictions
    parser = _Parser(prog="python -m simulator predict",
                     description="Predictions for deep_ep's kernels on H200 (intranode EP2/4/8, low-latency "
                                 "EP2/4/8, internode on 2 virtual nodes x 1/2/4 GPUs), to be checked by measurement.")
    parser.add_argument("--calibration", default=None, metavar="FILE.json",
                        help="deep_ep calibration to use (default simulator/data/calibration_deep_ep.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.calibration is not None and not os.path.isfile(args.calibration):
        parser.error(f"--calibration must be an existing file, got {args.calibration!r}")
    try:
        rows = predictions.predict(args.calibration)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    print(predictions.to_json(rows, args.calibration) if args.json else predictions.to_markdown(rows),
          end="\n" if args.json else "")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "validate":
            return run_validate(argv[1:])
        if argv and argv[0] == "predict":
            return run_predict(argv[1:])
        return run_plan(argv)
    except BrokenPipeError:  # the reader closed the pipe (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
