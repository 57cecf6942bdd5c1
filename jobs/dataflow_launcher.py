"""The Dataflow launcher's command line: ``python -m jobs.dataflow_launcher``, the executable
``submit dataflow`` runs (``pipeline.cloud.dataflow.launcher_command``) to start one stage as
a Dataflow job or to read a job's state; ``pipeline.cloud.dataflow_stages`` does the work.

    python -m jobs.dataflow_launcher run plan SETTINGS-FLAGS [--overwrite] [--cap-hosts N] -- OPTION...
    python -m jobs.dataflow_launcher run generate --out OUT -- OPTION...
    python -m jobs.dataflow_launcher run collect --out OUT -- OPTION...
    python -m jobs.dataflow_launcher state JOB_ID -- OPTION...

SETTINGS-FLAGS are the run's settings as ``promptmill plan`` takes them (``--prompts``,
``--out``, ``--model``, ..., ``--devices-per-host``; ``pipeline.cloud.gke.settings_flags``
writes every setting), read with the CLI's own flags and translation
(``jobs.flags.add_settings_flags``, ``settings_from_args``), so the plan job plans what
``submit gke``'s plan command would. Each call prints one JSON line, ``{"job_id": ...,
"state": ...}``, and exits 0; a failure exits non-zero with the reason on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from jobs import flags
from pipeline.cloud import dataflow_stages as launcher


def parser() -> flags.Parser:
    top = flags.Parser(prog="python -m jobs.dataflow_launcher", description=__doc__.split("\n")[0],
                       epilog="After --: the job's DataflowRunner options (for state: project and region).")
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="submit one stage as a Dataflow job")
    stages = run.add_subparsers(dest="stage", required=True)
    plan = stages.add_parser("plan", help="prepare (run.json) here, then submit the plan")
    flags.add_settings_flags(plan)
    plan.add_argument("--devices-per-host", type=int, default=1, help="the generate workers' chips (default: "
                      "%(default)s)")
    plan.add_argument("--overwrite", action="store_true", help="delete an earlier run in OUT first")
    plan.add_argument("--cap-hosts", type=int, help="the per-device batch was chosen by auto: lower it to what the "
                      "run fills on this many hosts")
    for stage in launcher.STAGES[1:]:
        stages.add_parser(stage, help=f"submit the {stage} job of OUT").add_argument("--out", required=True)
    state = commands.add_parser("state", help="a Dataflow job's state")
    state.add_argument("job_id")
    return top


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's own arguments, the Dataflow options after ``--``). The options are split
    off first: argparse's subcommands do not pass ``--`` and what follows it through reliably."""
    if "--" in argv:
        cut = argv.index("--")
        argv, options = argv[:cut], argv[cut + 1:]
    else:
        options = []
    return parser().parse_args(argv), options


def plan_settings(args: argparse.Namespace):
    """The Settings of a parsed ``run plan``; ``tpu_check``: the submission's, whose check reads
    ``--device-memory`` as the chip's."""
    return flags.settings_from_args(args, args.devices_per_host, tpu_check=True).validate()


def main(argv: list[str] | None = None) -> int:
    args, options = parse(sys.argv[1:] if argv is None else list(argv))
    if args.command == "run" and args.stage == "plan":
        answer = launcher.launch("plan", args.out, options, plan_settings(args), args.overwrite, args.cap_hosts)
    elif args.command == "run":
        answer = launcher.launch(args.stage, args.out, options)
    else:
        answer = launcher.job_state(args.job_id, options)
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
