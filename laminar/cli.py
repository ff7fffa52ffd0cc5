"""`laminar` command line. Heavy modules (torch, zmq, transformers) load only inside commands.

laminar node --role relay --config configs/demo.yaml [--index 0] [key=value ...]
laminar run [configs/demo.yaml] [--resume | --overwrite] [key=value ...]   # every role on this host
laminar status [--config F] [--json]                  # cluster table from the manager
laminar keys DIR [--name NAME] [--roles R,..] [--force]  # CURVE pairs; --roles: identity per role
laminar --version
laminar report RUN_DIR                                # report.png + summary.md of a run
laminar journal check RUN_DIR                         # verify every journal of a run offline
laminar plan CONFIG [--gpu-mem GiB] [--gpus-per-node N] [key=value ...]   # per-GPU memory plan
laminar config CONFIG --get KEY [key=value ...]       # one resolved setting (for launchers)
laminar export CHECKPOINT OUT_DIR                     # an HF directory of a (sharded) checkpoint
"""

from __future__ import annotations

import argparse
import sys

from laminar import __version__
from laminar.config import ROLES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="laminar", description="Asynchronous RL post-training for LLMs."
    )
    p.add_argument("--version", action="version", version=f"laminar {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    node = sub.add_parser("node", help="run one node (per-host daemon, SLURM task)")
    node.add_argument("--role", required=True, choices=ROLES)
    node.add_argument("--config", default=None, help="YAML run config")
    node.add_argument("--index", type=int, default=0, help="instance index of this role")
    node.add_argument(
        "--count",
        type=int,
        default=1,
        help="run this many instances (index, index+1, ...) in one process",
    )
    node.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    run = sub.add_parser("run", help="start every role of a config on this host as child processes")
    run.add_argument("config", nargs="?", default=None, help="YAML run config")
    again = run.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue the run in run_dir, even a finished one"
    )
    again.add_argument(
        "--overwrite", action="store_true", help="delete the run in run_dir and start over"
    )
    run.add_argument(
        "--skip-plan",
        action="store_true",
        help="start even where `laminar plan` says a process does not fit its GPU",
    )
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    pl = sub.add_parser("plan", help="per-GPU peak memory of each process, checked against a GPU")
    pl.add_argument("config", help="YAML run config")
    pl.add_argument("--gpu-mem", type=float, default=80.0, help="GiB of one GPU (default 80)")
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument(
        "--trainer-gpus",
        type=int,
        default=None,
        help="trainer ranks per trainer node (default: half the node, as the sbatch)",
    )
    pl.add_argument("--trainer-nodes", type=int, default=1)
    pl.add_argument(
        "--limit", type=float, default=0.9, help="share of a GPU a process may use (default 0.9)"
    )
    pl.add_argument("--json", action="store_true", help="JSON instead of a table")
    pl.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    ex = sub.add_parser("export", help="write an HF model directory of a trainer checkpoint")
    ex.add_argument("checkpoint", help="a run's checkpoints/step_N directory")
    ex.add_argument("out", help="the HF directory to write")

    cg = sub.add_parser("config", help="print one setting of a config, overrides applied")
    cg.add_argument("config", help="YAML run config")
    cg.add_argument("--get", required=True, help="dotted key, e.g. transport.stop_timeout_s")
    cg.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    st = sub.add_parser("status", help="print the cluster's nodes (asks the manager)")
    st.add_argument("--config", default=None)
    st.add_argument("--json", action="store_true", help="JSON instead of a table")
    st.add_argument("--timeout", type=float, default=3.0)
    st.add_argument("overrides", nargs="*")

    jr = sub.add_parser("journal", help="inspect a run's journals offline")
    jr_sub = jr.add_subparsers(dest="journal_cmd", required=True)
    jr_check = jr_sub.add_parser("check", help="verify every journal in RUN_DIR (exit 1: problems)")
    jr_check.add_argument("run_dir", help="the run's directory")

    rep = sub.add_parser("report", help="write report.png + summary.md for a run directory")
    rep.add_argument("run_dir", help="the run's directory (run_dir, default runs/<name>)")

    keys = sub.add_parser("keys", help="create a CURVE key pair and authorized-keys directory")
    keys.add_argument("dir")
    keys.add_argument(
        "--name", default=None, help="pair name (default node; with --roles: per host)"
    )
    keys.add_argument(
        "--roles",
        default=None,
        help=(
            "comma list: one pair per role (or, with --name, one host pair) that may claim only "
            "these"
        ),
    )
    keys.add_argument("--force", action="store_true", help="replace an existing key pair")
    return p


def _split_overrides(args: argparse.Namespace) -> None:
    # `laminar run k=v` (no file): argparse puts the first override into `config`
    if (
        args.cmd == "run"
        and args.config
        and "=" in args.config
        and not args.config.endswith((".yaml", ".yml"))
    ):
        args.overrides = [args.config, *args.overrides]
        args.config = None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # key=value overrides may follow options (`laminar plan CFG --gpu-mem 80 k=v`)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    _split_overrides(args)
    from laminar.config import ConfigError

    try:
        if args.cmd == "node":
            from laminar.launch.node import node_main

            return node_main(args.role, args.config, args.overrides, args.index, args.count)
        if args.cmd == "run":
            from laminar.launch.run import run_main

            return run_main(
                args.config, args.overrides, args.resume, args.overwrite, args.skip_plan
            )
        if args.cmd == "plan":
            from laminar.plan.command import plan_main
            from laminar.plan.memory import Hardware

            hw = Hardware(
                gpu_gib=args.gpu_mem,
                gpus_per_node=args.gpus_per_node,
                trainer_gpus=args.trainer_gpus,
                trainer_nodes=args.trainer_nodes,
                limit=args.limit,
            )
            return plan_main(args.config, args.overrides, hw, args.json)
        if args.cmd == "export":
            from laminar.trainer.checkpoint import export_hf

            print(f"wrote {export_hf(args.checkpoint, args.out)}")
            return 0
        if args.cmd == "config":
            from laminar.config import load_config

            value = load_config(args.config, args.overrides)
            for part in args.get.split("."):
                if not hasattr(value, part):
                    print(f"laminar config: no setting {args.get!r}", file=sys.stderr)
                    return 2
                value = getattr(value, part)
            print("" if value is None else value)
            return 0
        if args.cmd == "status":
            from laminar.launch.status import status_main

            return status_main(args.config, args.overrides, args.json, args.timeout)
        if args.cmd == "journal":
            from laminar.journal_check import journal_check_main

            return journal_check_main(args.run_dir)
        if args.cmd == "report":
            from laminar.report import report_main

            return report_main(args.run_dir)
        if args.cmd == "keys":
            from laminar.transport.security import generate_keys, generate_role_keys

            roles = [r for r in (args.roles or "").split(",") if r]
            try:
                if roles and args.name is None:
                    written = generate_role_keys(args.dir, roles, force=args.force)
                    print(
                        f"wrote {len(written)} key pairs in {args.dir}; roles in "
                        f"{args.dir}/roles.json"
                    )
                    return 0
                name = args.name or "node"
                public, secret = generate_keys(
                    args.dir, name, force=args.force, roles=roles or None
                )
            except FileExistsError as exc:
                print(f"laminar keys: {exc}", file=sys.stderr)
                return 2
            print(f"wrote {public} and {secret}; authorized {name} in {args.dir}/authorized/")
            return 0
    except ConfigError as exc:
        print(f"laminar: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
