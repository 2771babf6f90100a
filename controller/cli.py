"""`specd controller`, `specd alpha`, `specd segments`, `specd policy`: the daemon and its clients."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from specd_api.errors import SpecdError

DEFAULT_ADDRESS = "127.0.0.1:50061"


class ControllerUnreachable(SpecdError):
    pass


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("controller", help="run the controller daemon")
    p.add_argument("--config", default="configs/controller.yaml", help="daemon configuration (YAML)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=run_daemon)

    address_help = f"controller address (default: $SPECD_CONTROLLER or {DEFAULT_ADDRESS})"
    p = commands.add_parser("alpha", help="per-segment acceptance rates learned by the controller")
    p.add_argument("segment", nargs="?", help="one segment (default: all)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--address", help=address_help)
    p.set_defaults(handler=run_alpha)

    p = commands.add_parser("costs", help="the costs the controller learned: target step, c and v(n) per batch bucket")
    p.add_argument("--json", action="store_true")
    p.add_argument("--address", help=address_help)
    p.set_defaults(handler=run_costs)

    p = commands.add_parser("segments", help="the segments the controller knows, with their decisions")
    p.add_argument("--json", action="store_true")
    p.add_argument("--address", help=address_help)
    p.set_defaults(handler=run_segments)

    p = commands.add_parser("policy", help="check, show or reload the policy")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    check = actions.add_parser("check", help="validate policy files (exit 1 if any is invalid)")
    check.add_argument("files", nargs="+", metavar="FILE")
    for name, text in (("show", "print the policy in force"), ("reload", "make the daemon re-read its policy")):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--address", help=address_help)
    p.set_defaults(handler=run_policy)


def run_daemon(args: argparse.Namespace) -> int:
    from controller.config import load_config
    from controller.server import ControllerDaemon

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ControllerDaemon(load_config(args.config)).run()


def _stub(address: str | None) -> Any:
    from specd_api.v1 import controller_pb2_grpc

    channel = grpc.insecure_channel(address or os.environ.get("SPECD_CONTROLLER") or DEFAULT_ADDRESS)
    return controller_pb2_grpc.ControllerStub(channel)


def _call(address: str | None, method: str, request: Any) -> Any:
    try:
        return getattr(_stub(address), method)(request, timeout=10)
    except grpc.RpcError as e:
        where = address or os.environ.get("SPECD_CONTROLLER") or DEFAULT_ADDRESS
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            raise ControllerUnreachable(f"no controller answers at {where} ({e.details()})") from None
        raise SpecdError(f"{method} failed: {e.code().name}: {e.details()}") from None


def run_alpha(args: argparse.Namespace) -> int:
    from specd_api.v1 import controller_pb2 as pb

    if args.segment:
        segments = [_call(args.address, "GetSegmentStats", pb.GetSegmentStatsRequest(segment=args.segment))]
    else:
        segments = list(_call(args.address, "ListSegments", pb.ListSegmentsRequest()).segments)
    if args.json:
        print(json.dumps([segment_summary(s) for s in segments], indent=2))
        return 0
    header = ("segment", "drafter", "K", "rounds", "alpha", "95% CI", "tau", "exp.speedup")
    print("{:<20} {:<14} {:>3} {:>9} {:>6} {:>13} {:>5} {:>11}".format(*header))
    for s in segments:
        rows = [(d, k) for d in s.drafters for k in d.by_k if k.rounds >= 0.5]
        for d, k in rows:
            ci = f"{k.alpha_ci_low:.2f}-{k.alpha_ci_high:.2f}"
            print(
                f"{s.segment:<20} {d.drafter:<14} {k.k:>3} {k.rounds:>9.1f} {k.alpha:>6.2f} "
                f"{ci:>13} {k.mean_accepted_length:>5.2f} {k.expected_speedup:>10.2f}x"
            )
        if not rows:
            print(f"{s.segment:<20} (no rounds served yet)")
        for d in s.drafters:
            line = evidence_line(d)
            if line:
                print(f"{'':<20} {d.drafter:<14} {line}")
        for alarm in s.drift:
            print(f"{'':<20} drift: {describe_drift(alarm)}")
        print(f"{'':<20} decision: {describe(s.decision)}{'  [stale]' if s.stale else ''}")
    return 0


def evidence_line(drafter: Any) -> str:
    """Served and counterfactual rounds apart (at the first position, which every round with a draft reaches),
    and the per-position acceptance estimate decisions use."""
    parts = []
    for name, positions in (("served", drafter.positions), ("scored", drafter.counterfactual_positions)):
        if positions and positions[0].offered >= 0.5:
            first = positions[0]
            parts.append(f"{name} {first.offered:.0f} rounds, a0 {first.conditional_alpha:.2f}")
    if not parts:
        return ""
    estimate = " ".join(f"{a:.2f}" for a in drafter.acceptance[:8])
    return " | ".join(parts) + f" | estimate a_i: {estimate}"


def describe_drift(alarm: Any) -> str:
    import time

    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(alarm.since_unix))
    return f"{alarm.drafter} {alarm.direction} from {alarm.alpha_before:.2f} to {alarm.alpha_since:.2f} since {since}"


def run_costs(args: argparse.Namespace) -> int:
    from specd_api.v1 import controller_pb2 as pb

    model = _call(args.address, "GetCosts", pb.GetCostsRequest())
    if args.json:
        print(json.dumps(MessageToDict(model, preserving_proto_field_name=True), indent=2))
        return 0
    if not model.buckets:
        print("no timings reported yet: decisions use the policy's cost_ratio and v(n) = 1 + 0.02 n")
        return 0
    for b in model.buckets:
        c = ", ".join(f"c({d}) = {v:.3f}" for d, v in sorted(b.cost_ratio.items())) or "c not measured"
        print(f"batch bucket {b.batch_bucket}: target step {b.step_seconds * 1e3:.2f} ms, {c}")
        measured = [f"v({n}) = {v:.2f}" + ("" if n < len(b.verify_rounds) and b.verify_rounds[n] else "*")
                    for n, v in enumerate(b.verify_cost)]  # fmt: skip
        print("  " + ", ".join(measured) + "   (* interpolated)")
    return 0


def run_segments(args: argparse.Namespace) -> int:
    from specd_api.v1 import controller_pb2 as pb

    segments = list(_call(args.address, "ListSegments", pb.ListSegmentsRequest()).segments)
    if args.json:
        print(json.dumps([segment_summary(s) for s in segments], indent=2))
        return 0
    print(f"{'segment':<24} {'rounds':>9} {'alpha':>6}  decision")
    for s in segments:
        alpha = overall_alpha(s)
        alpha_text = f"{alpha:.2f}" if alpha is not None else "-"
        drift = "".join(f"  [α drift: {describe_drift(a)}]" for a in s.drift)
        print(f"{s.segment:<24} {s.rounds:>9.1f} {alpha_text:>6}  {describe(s.decision)}{drift}")
    return 0


def run_policy(args: argparse.Namespace) -> int:
    from specd_api.v1 import controller_pb2 as pb

    if args.action == "check":
        return check_policies(args.files)
    if args.action == "show":
        info = _call(args.address, "GetPolicy", pb.GetPolicyRequest())
        print(f"# version {info.version} from {info.path}")
        print(info.text, end="" if info.text.endswith("\n") else "\n")
        return 0
    info = _call(args.address, "ReloadPolicy", pb.ReloadPolicyRequest())
    print(f"policy reloaded: version {info.version} from {info.path}")
    return 0


def check_policies(files: list[str]) -> int:
    from controller.policy import load_policy
    from specd_api.yaml_config import ConfigError

    failed = False
    for path in files:
        try:
            policy = load_policy(path)
        except ConfigError as e:
            failed = True
            for issue in e.issues:
                print(issue, file=sys.stderr)
            continue
        print(f"{path}: ok (version {policy.version}, {len(policy.document.segments)} segment rules)")
    return 1 if failed else 0


def describe(decision: Any) -> str:
    if decision.drafter == "none":
        return f"off ({decision.reason})"
    return f"{decision.drafter} K<={decision.k} ({decision.reason}, x{decision.expected_speedup:.2f})"


def overall_alpha(segment: Any) -> float | None:
    proposed = sum(k.proposed for d in segment.drafters for k in d.by_k)
    accepted = sum(k.accepted for d in segment.drafters for k in d.by_k)
    return accepted / proposed if proposed else None


def segment_summary(segment: Any) -> dict[str, Any]:
    """The JSON form: the full message, plus α per drafter over all K for quick reading."""
    summary = MessageToDict(segment, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    summary["alpha_by_drafter"] = {
        d.drafter: (sum(k.accepted for k in d.by_k) / sum(k.proposed for k in d.by_k))
        for d in segment.drafters
        if sum(k.proposed for k in d.by_k) > 0
    }
    summary["counterfactual_alpha_by_drafter"] = {
        d.drafter: d.counterfactual_positions[0].conditional_alpha
        for d in segment.drafters
        if d.counterfactual_positions and d.counterfactual_positions[0].verified > 0
    }
    summary["alpha"] = overall_alpha(segment)
    return summary
