"""``submit gke``: plan, then a JobSet that generates on a GKE TPU slice, then collect.

``plan`` (Beam, local by default), ``kubectl apply`` of the JobSet
(``pipeline.cloud.jobset``), a wait that follows the committed slices and the JobSet's
conditions, then ``collect``. A failed or restarted JobSet loses nothing: hosts skip
committed slices, so a restart, or re-running the same command, resumes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import time
from typing import Callable

from pipeline.cloud import jobset, kubectl as kubectl_lib, program_check
from pipeline.core import naming
from pipeline.core.numbers import counted
from pipeline.io import ledgers, runs, storage

KUBECTL_FAILURES_TOLERATED = 5  # consecutive failed status polls before the wait gives up


# Settings fields that are no flag of `promptmill plan`, and why. settings_flags leaves them
# out, so a plan command plans them as they are decided there.
NOT_FLAGS = {
    "guidance_rule": "decided by the model's family when the run is planned (prepare); a resumed run keeps its own",
    "guided": "decided by the plan: whether any planned record's guidance asks for it under the run's rule",
}
# Settings fields written within another's flag: each size's per-device batch is --per-device-batch N,N,...
WITHIN = {"bucket_batches": "per_device_batch"}
# The fields whose flag is not --NAME-WITH-DASHES (the flag names one item of the tuple)
FLAG_NAMES = {"loras": "--lora", "formats": "--format", "scores": "--score"}
REPEATED = ("loras",)  # one flag per item (action="append"); any other tuple is one comma-separated flag


def setting_flag(name: str) -> str:
    """The ``promptmill plan`` flag of the Settings field ``name``."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def settings_flags(settings) -> list[str]:
    """The ``promptmill plan`` flags that give ``settings``: the inverse of ``jobs/flags.py``'s
    ``settings_from_args`` (``jobs.flags.settings_from_flags`` reads them back).

    Every field of Settings (``dataclasses.fields``) is a flag but those of ``NOT_FLAGS``:
    ``--NAME-WITH-DASHES VALUE`` (``FLAG_NAMES`` for the others), a number or ``auto`` as
    text, a float as its repr (which reads back to the same float), a store_true flag when
    true, a tuple as one comma-separated flag (``--format``, ``--score``) or one flag per
    item (``--lora PATH@SCALE``, ``REPEATED``); None and an empty tuple are left out, which
    reads back as the default. Every other value is written out, defaults too: a plan
    command reads the same settings whatever the command's own defaults (submit's ``--dtype``
    is bf16, plan's fp32). A value that starts with '-' is written ``--flag=VALUE``, so it is
    never taken for a flag. ``devices_per_host`` is ``--devices-per-host``, a flag of ``plan``
    (a submission sets it from the TPU slice). A value the flags cannot say is a ValueError.
    """
    tokens: list[str] = []
    for field in dataclasses.fields(settings):
        if field.name in NOT_FLAGS or field.name in WITHIN:
            continue
        value = getattr(settings, field.name)
        if field.name == "per_device_batch" and settings.bucket_batches:
            value = tuple(settings.bucket_batches)  # one per size: what the TPU check chose for each
        flag = setting_flag(field.name)
        if value is None or value == ():
            if value != field.default:
                raise ValueError(f"{field.name}={value!r} cannot be given as flags: without {flag}, a plan "
                                 f"takes {field.default!r}")
            continue
        if isinstance(value, bool):
            if value:
                tokens.append(flag)
            elif field.default is not False:
                raise ValueError(f"{field.name}=False cannot be given as flags: {flag} only turns it on")
            continue
        if isinstance(value, (tuple, list)):
            items = [str(item) for item in value] if field.name in REPEATED else [",".join(map(str, value))]
        elif isinstance(value, float):
            items = [repr(value)]
        else:
            items = [str(value)]
        for item in items:
            tokens += [f"{flag}={item}"] if item.startswith("-") else [flag, item]
    return tokens


def settings_lines(settings) -> list[str]:
    """A dry run's lines for the settings it would plan: those the flags give (the plan's
    own decisions, ``NOT_FLAGS``, are named, not guessed: run.json records them)."""
    given = {name: value for name, value in settings.to_dict().items() if name not in NOT_FLAGS}
    return ["# settings: " + json.dumps(given, sort_keys=True),
            f"# decided when the run is planned (then in run.json): {', '.join(sorted(NOT_FLAGS))}"]


def plan_command(settings, beam_args: list[str] | tuple = ()) -> list[str]:
    """The ``promptmill plan`` command line that plans ``settings`` (what submit gke runs first):
    every setting, as ``settings_flags`` writes them, then ``beam_args``."""
    return ["promptmill", "plan", *settings_flags(settings), *beam_args]


# said once, in the dry run and when a JobSet is applied, when --service-account is not given
NO_SERVICE_ACCOUNT = ("# no --service-account: the JobSet's pods run as the namespace's default Kubernetes service "
                      "account, which must reach the bucket (Workload Identity); give --service-account KSA to "
                      "choose one")


def gke_dry_run(job: jobset.GkeJob) -> str:
    """What ``submit gke --dry-run`` prints: every command, then the manifests (valid multi-document YAML)."""
    job.validate()
    base = shlex.join(kubectl_lib.kubectl_base(job.namespace, os.environ.get("KUBECTL") or "kubectl"))
    stats = naming.join(job.out, "shards", "*_stats.json")
    collect = ["promptmill", "collect", "--out", job.out, *job.collect_beam_args]
    lines = [
        "# promptmill submit gke --dry-run: nothing was run. It would run, in order:",
        f"# TPU slice: {job.tpu_slice.describe()}",
        "# " + program_check.summary(job.tpu_program),
        "# 1. plan (Beam):",
        "#    " + shlex.join(plan_command(job.settings, job.plan_beam_args) + (["--overwrite"] if job.overwrite else [])),
        *([f"#    (run in-process, with the per-device batch that auto chose for the chip lowered to what the run "
           f"fills on {job.cap_hosts} host(s))"] if job.cap_hosts is not None else []),
        f"# 2. {base} get jobset {job.name} -o json --ignore-not-found"
        "   (a finished JobSet of this name is deleted first; a running one is waited on, not applied again)",
        f"# 3. {base} apply -f -   (stdin: the manifest below)",
        f"# 4. wait: every {job.poll_s:g} s count the committed slices (the hosts' ledgers under "
        f"{naming.ledger_dir(job.out)}, else {stats}) and read "
        f"`{base} get jobset {job.name} -o json` until its Completed condition (a Failed one is an error)",
        "# 5. collect (Beam):",
        "#    " + shlex.join(collect),
        *settings_lines(job.settings),
        *([] if job.service_account else [NO_SERVICE_ACCOUNT]),
    ]
    return "\n".join(lines) + "\n---\n" + jobset.to_yaml(jobset.manifests(job))


def committed_slices(out: str, total: int) -> int:
    """How many of the ``total`` planned slices are committed: from the hosts' ledgers when
    they can be trusted (O(hosts) objects: ``ledgers.committed``), else from one listing of
    the commit markers (``shards/NNNNN_stats.json``)."""
    if runs.exists(out) and storage.exists(naming.manifest(out)):
        return ledgers.committed(out, runs.read(out), storage.read_json(naming.manifest(out))).slices
    return sum(index < total for index in runs.committed(out))


def apply_jobset(kubectl: kubectl_lib.Kubectl, job: jobset.GkeJob, emit: Callable[[str], None]) -> str:
    """Create the JobSet: apply it; replace a finished one of the same name; attach to a running one."""
    state, _ = kubectl_lib.jobset_state(kubectl.get_jobset(job.name))
    if state == "running":
        emit(f"JobSet {job.name} is already running: waiting for it instead of applying it again")
        return "attached"
    if state in ("completed", "failed"):
        emit(f"JobSet {job.name} exists and is {state}: deleting it so a new one resumes {job.out}")
        kubectl("delete", "jobset", job.name, "--wait=true")
    if not job.service_account:
        emit(NO_SERVICE_ACCOUNT.lstrip("# "))
    kubectl("apply", "-f", "-", stdin=jobset.to_yaml(jobset.manifests(job)))
    emit(f"JobSet {job.name} applied: {job.tpu_slice.describe()}")
    return "applied"


def wait_for_jobset(kubectl: kubectl_lib.Kubectl, job: jobset.GkeJob, total: int, emit: Callable[[str], None],
                    sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll until the JobSet completes with every slice committed; returns the committed count.

    Prints ``committed/total`` and the JobSet's restarts whenever they change. A Failed JobSet, a JobSet that
    disappears, or one that completes with slices missing is a RuntimeError; so are
    ``KUBECTL_FAILURES_TOLERATED`` failed status calls in a row.
    """
    last = None
    last_status = None
    failures = 0
    while True:
        done = committed_slices(job.out, total)
        if done != last:
            emit(f"{done}/{total} slices committed")
            last = done
        try:
            state, message = kubectl_lib.jobset_state(kubectl.get_jobset(job.name))
            failures = 0
        except (RuntimeError, ValueError) as e:
            failures += 1
            if failures >= KUBECTL_FAILURES_TOLERATED:
                raise RuntimeError(f"could not read JobSet {job.name}'s status {failures} times in a row: {e}") from e
            sleep(job.poll_s)
            continue
        resume = "committed slices are kept: re-running the same command resumes"
        if state == "failed":
            raise RuntimeError(f"JobSet {job.name} failed ({message}) with {committed_slices(job.out, total)}/{total} "
                               f"slices committed; see `kubectl --namespace {job.namespace} logs -l "
                               f"jobset.sigs.k8s.io/jobset-name={job.name}`; {resume}")
        if state == "absent":
            raise RuntimeError(f"JobSet {job.name} disappeared with {done}/{total} slices committed; {resume}")
        if state == "completed":
            done = committed_slices(job.out, total)
            if done != last:
                emit(f"{done}/{total} slices committed")
            if done < total:
                raise RuntimeError(f"JobSet {job.name} completed but only {done}/{total} slices are committed in "
                                   f"{job.out}; {resume}")
            return done
        if message != last_status:  # started, or restarted after a host failed
            emit(f"JobSet {job.name} running ({message})")
            last_status = message
        sleep(job.poll_s)


def stopped_following(job: jobset.GkeJob) -> str:
    """What ``submit gke`` says when Ctrl-C or SIGTERM stops it while the JobSet runs: the
    JobSet is left running, never cancelled silently, and this is how to cancel it."""
    base = shlex.join(kubectl_lib.kubectl_base(job.namespace, os.environ.get("KUBECTL") or "kubectl"))
    return (f"stopped following JobSet {job.name}; it keeps running, and what it commits is kept. Watch it: "
            f"`promptmill status {job.out}`; follow it again (and collect once it is done): the same submit command; "
            f"cancel it: `{base} delete jobset {job.name}` (every host stops at its next batch; the same submit "
            f"command later resumes from the committed slices)")


def submit_gke(job: jobset.GkeJob, emit: Callable[[str], None] = print, kubectl: kubectl_lib.Kubectl | None = None,
               sleep: Callable[[float], None] = time.sleep) -> dict:
    """plan -> kubectl apply -> wait -> collect; returns collect's stats."""
    job.validate()
    from pipeline.collect import transforms as collect
    from pipeline.plan import transforms as plan

    kubectl = kubectl or kubectl_lib.Kubectl(job.namespace)  # a missing kubectl fails here, before anything is done
    manifest = plan.run_plan(job.settings, list(job.plan_beam_args), job.overwrite, job.cap_hosts)
    emit(f"planned {counted(manifest['records'], 'record')}, {counted(manifest['images'], 'image')} in "
         f"{counted(manifest['slices'], 'slice')} for {counted(job.tpu_slice.hosts, 'host')} x "
         f"{counted(job.tpu_slice.chips_per_host, 'chip')}")
    # a plan that made the run guided runs a larger program than the one checked
    program_check.check_planned(job.out, job.settings if job.tpu_program else None,
                                job.tpu_slice)
    apply_jobset(kubectl, job, emit)
    follow_jobset(kubectl, job, manifest["slices"], emit, sleep)
    return collect.run_collect(job.out, list(job.collect_beam_args))


def follow_jobset(kubectl: kubectl_lib.Kubectl, job: jobset.GkeJob, total: int, emit: Callable[[str], None],
                  sleep: Callable[[float], None] = time.sleep) -> int:
    """``wait_for_jobset``; at Ctrl-C or SIGTERM (a KeyboardInterrupt, ``pipeline.core.interrupts``)
    it says how to watch, follow or cancel the JobSet it leaves running, and raises again."""
    try:
        return wait_for_jobset(kubectl, job, total, emit, sleep)
    except KeyboardInterrupt:
        emit(stopped_following(job))
        raise
