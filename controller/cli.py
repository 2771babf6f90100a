"""`specd controller`, `specd alpha`, `specd segments`, `specd costs`, `specd policy`: the daemon and its clients.

The client commands reach the controller at ``--address`` (else $SPECD_CONTROLLER, else 127.0.0.1:50061), over TLS
and with a bearer token when asked to, by flags or by the environment (``CREDENTIAL_ENV``), flags first."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from specd_api.errors import SpecdError, UsageError
from specd_api.security import ControllerCredentials, controller_channel
from specd_api.targets import parse_target

DEFAULT_ADDRESS = "127.0.0.1:50061"
# flag -> the environment variable it defaults to
CREDENTIAL_ENV = {
    "tls": "SPECD_CONTROLLER_TLS",
    "ca_file": "SPECD_CONTROLLER_CA",
    "cert_file": "SPECD_CONTROLLER_CERT",
    "key_file": "SPECD_CONTROLLER_KEY",
    "server_name": "SPECD_CONTROLLER_SERVER_NAME",
    "token_file": "SPECD_CONTROLLER_TOKEN_FILE",
}
TOKEN_ENV = "SPECD_CONTROLLER_TOKEN"  # the token itself, when there is no token file


class ControllerUnreachable(SpecdError):
    pass


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("controller", help="run the controller daemon")
    p.add_argument("--config", default="configs/controller.yaml", help="daemon configuration (YAML)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=run_daemon)

    p = commands.add_parser("alpha", help="per-segment acceptance rates learned by the controller")
    p.add_argument("segment", nargs="?", help="one segment (default: all)")
    p.add_argument("--json", action="store_true")
    add_connection_args(p)
    p.set_defaults(handler=run_alpha)

    p = commands.add_parser("costs", help="the costs the controller learned: target step, c and v(n) per batch bucket")
    p.add_argument("--json", action="store_true")
    add_connection_args(p)
    p.set_defaults(handler=run_costs)

    p = commands.add_parser("segments", help="the segments the controller knows, with their decisions")
    p.add_argument("--json", action="store_true")
    add_connection_args(p)
    p.set_defaults(handler=run_segments)

    p = commands.add_parser("policy", help="check, show or reload the policy")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    check = actions.add_parser("check", help="validate policy files (exit 1 if any is invalid)")
    check.add_argument("files", nargs="+", metavar="FILE")
    for name, text in (("show", "print the policy in force"), ("reload", "make the daemon re-read its policy")):
        sub = actions.add_parser(name, help=text)
        add_connection_args(sub)
    p.set_defaults(handler=run_policy)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help=f"controller address (default: $SPECD_CONTROLLER or {DEFAULT_ADDRESS})")
    group = p.add_argument_group("controller credentials (each flag defaults to the environment variable named)")
    env = CREDENTIAL_ENV
    tls_help = f"TLS, trusting the system's roots (${env['tls']}=1); the flags below imply it"
    group.add_argument("--tls", action="store_true", default=None, help=tls_help)
    group.add_argument("--ca-file", help=f"PEM: the CA the controller's certificate must chain to (${env['ca_file']})")
    group.add_argument("--cert-file", help=f"PEM: this client's certificate, for mutual TLS (${env['cert_file']})")
    group.add_argument("--key-file", help=f"PEM: its private key (${env['key_file']})")
    group.add_argument("--server-name", help=f"check the certificate for this name (${env['server_name']})")
    group.add_argument("--token-file", help=f"a file holding the bearer token (${env['token_file']}; else the "
                                            f"token itself in ${TOKEN_ENV})")  # fmt: skip


def credentials(args: argparse.Namespace) -> ControllerCredentials | None:
    """The TLS settings and token the flags or the environment give; None: plaintext, no token. A bad file fails
    here, in one line that names the flag (or variable) and the file."""
    from pydantic import ValidationError

    flags = {name: getattr(args, name, None) for name in CREDENTIAL_ENV}
    given = {name: flags[name] or os.environ.get(variable) for name, variable in CREDENTIAL_ENV.items()}
    tls = {key: given[key] for key in ("ca_file", "cert_file", "key_file", "server_name") if given[key]}
    use_tls = bool(tls) or str(given["tls"] or "").lower() in ("1", "true", "yes")
    token: dict[str, str] | None = None
    if given["token_file"]:
        token = {"file": given["token_file"]}
    elif os.environ.get(TOKEN_ENV):
        token = {"env": TOKEN_ENV}
    if not use_tls and token is None:
        return None
    try:
        return ControllerCredentials.model_validate({"tls": tls if use_tls else None, "token": token})
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        name = {"token": "token_file", "tls": "cert_file"}.get(str(first["loc"][-1]), str(first["loc"][-1]))
        from_flag = flags.get(name) or name not in CREDENTIAL_ENV
        where = f"--{name.replace('_', '-')}" if from_flag else f"${CREDENTIAL_ENV[name]}"
        raise UsageError(f"{where}: {str(first['msg']).removeprefix('Value error, ')}") from None


def run_daemon(args: argparse.Namespace) -> int:
    from controller.config import load_config
    from controller.server import ControllerDaemon

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ControllerDaemon(load_config(args.config)).run()


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    from specd_api.v1 import controller_pb2_grpc

    where = args.address or os.environ.get("SPECD_CONTROLLER") or DEFAULT_ADDRESS
    try:
        parse_target(where, "--address" if args.address else "$SPECD_CONTROLLER")
    except ValueError as e:
        raise UsageError(str(e)) from None
    creds = credentials(args)
    with controller_channel(where, creds) as channel:
        try:
            return getattr(controller_pb2_grpc.ControllerStub(channel), method)(request, timeout=10)
        except grpc.RpcError as e:
            raise call_error(e, method, where, creds) from None


def call_error(e: grpc.RpcError, method: str, where: str, creds: ControllerCredentials | None) -> SpecdError:
    """One line for a failed call, saying what to check."""
    code, details = (e.code(), e.details()) if isinstance(e, grpc.Call) else (None, str(e))
    if code == grpc.StatusCode.UNAVAILABLE and "handshake" in (details or "").lower():
        return ControllerUnreachable(f"the TLS handshake with {where} failed ({details}): check --ca-file, "
                                     "--cert-file/--key-file, and whether the controller speaks TLS")  # fmt: skip
    no_client_certificate = creds is not None and creds.tls is not None and creds.tls.cert_file is None
    if code == grpc.StatusCode.UNAVAILABLE and no_client_certificate:
        hint = "one that asks for client certificates closes connections without: --cert-file, --key-file"
        return ControllerUnreachable(f"no controller answers at {where} over TLS ({details}); {hint}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ControllerUnreachable(f"no controller answers at {where} ({details})")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return SpecdError(f"the controller at {where} refused {method}: {details} (--token-file or ${TOKEN_ENV})")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return SpecdError(f"the controller at {where} refused {method}: {details}")
    return SpecdError(f"{method} failed: {code.name if code else 'error'}: {details}")


def run_alpha(args: argparse.Namespace) -> int:
    from specd_api.v1 import controller_pb2 as pb

    if args.segment:
        segments = [_call(args, "GetSegmentStats", pb.GetSegmentStatsRequest(segment=args.segment))]
    else:
        segments = list(_call(args, "ListSegments", pb.ListSegmentsRequest()).segments)
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

    model = _call(args, "GetCosts", pb.GetCostsRequest())
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

    segments = list(_call(args, "ListSegments", pb.ListSegmentsRequest()).segments)
    if args.json:
        print(json.dumps([segment_summary(s) for s in segments], indent=2))
        return 0
    print(f"{'segment':<24} {'rounds':>9} {'alpha':>6} {'calibration':<28}  decision")
    for s in segments:
        alpha = overall_alpha(s)
        alpha_text = f"{alpha:.2f}" if alpha is not None else "-"
        drift = "".join(f"  [α drift: {describe_drift(a)}]" for a in s.drift)
        print(
            f"{s.segment:<24} {s.rounds:>9.1f} {alpha_text:>6} {calibration_text(s):<28}  {describe(s.decision)}{drift}"
        )
    print("calibration: realised / expected speedup, the median over the segment's recent requests per drafter")
    return 0


def calibration_text(segment: Any) -> str:
    """Realised / expected speedup per drafter with a measured request, e.g. "draft 0.97 (41)"; "-" when none."""
    parts = [f"{d.drafter} {d.calibration:.2f} ({d.calibration_requests:.0f})" for d in segment.drafters
             if d.calibration_requests >= 0.5]  # fmt: skip
    return ", ".join(parts) or "-"


def run_policy(args: argparse.Namespace) -> int:
    from specd_api.v1 import controller_pb2 as pb

    if args.action == "check":
        return check_policies(args.files)
    if args.action == "show":
        info = _call(args, "GetPolicy", pb.GetPolicyRequest())
        print(f"# version {info.version} from {info.path}")
        print(info.text, end="" if info.text.endswith("\n") else "\n")
        return 0
    info = _call(args, "ReloadPolicy", pb.ReloadPolicyRequest())
    print(f"policy reloaded: version {info.version} from {info.path}")
    return 0


def check_policies(files: list[str]) -> int:
    from controller.decision.policy import load_policy
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
