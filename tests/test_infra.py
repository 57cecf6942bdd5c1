"""The deployment files under infra/: the images' Dockerfiles, the scheduled-run workflow
and launcher, and the commands of infra/README.md.

Nothing here builds an image or calls Google Cloud: the Dockerfiles are parsed into their
instructions, the workflow is walked by a small interpreter of the Workflows subset it
uses, and every `promptmill ...` line of the README goes through promptmill's own parser.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from pipeline.cloud import dates as schedule
from tests.conftest import ROOT

INFRA = os.path.join(ROOT, "infra")
TPU_HOST = os.path.join(INFRA, "tpu-host", "Dockerfile")
DATAFLOW = os.path.join(INFRA, "dataflow", "Dockerfile")
LAUNCHER = os.path.join(INFRA, "schedule", "Dockerfile")
SUBMIT_SH = os.path.join(INFRA, "schedule", "submit.sh")
WORKFLOW = os.path.join(INFRA, "schedule", "workflow.yaml")
README = os.path.join(INFRA, "README.md")
LIBTPU_INDEX = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"


# -- Dockerfiles ------------------------------------------------------------------------

def _expand(text: str, variables: dict[str, str]) -> str:
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in variables, f"${name} is used but never declared (ARG or ENV)"
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def parse_dockerfile(path: str) -> list[dict]:
    """The stages of a Dockerfile: {"from", "alias", "instructions": [(INSTRUCTION, args)]},
    with line continuations joined, comments dropped and ARG/ENV values put in place."""
    logical, pending = [], ""
    for raw in open(path, encoding="utf-8").read().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a line continuation"

    global_args: dict[str, str] = {}
    stages: list[dict] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            image, _, alias = _expand(rest, global_args).partition(" AS ")
            if not alias:
                image, _, alias = image.partition(" as ")
            stages.append({"from": image.strip(), "alias": alias.strip() or None, "instructions": [],
                           "vars": {}})
            continue
        if not stages:
            assert instruction == "ARG", f"{path}: only ARG may come before the first FROM, got {instruction}"
            name, _, default = rest.partition("=")
            global_args[name] = default
            continue
        stage = stages[-1]
        if instruction == "ARG":
            name, eq, default = rest.partition("=")
            stage["vars"][name] = _expand(default, stage["vars"]) if eq else global_args.get(name, "")
        elif instruction == "ENV":
            for name, val in re.findall(r"(\w+)=(\S+)", rest):
                stage["vars"][name] = _expand(val, stage["vars"])
        stage["instructions"].append((instruction, _expand(rest, stage["vars"])))
    assert stages, f"{path} has no FROM"
    return stages


def _all(stage: dict, instruction: str) -> list[str]:
    return [args for name, args in stage["instructions"] if name == instruction]


def _entrypoint(stage: dict) -> list[str]:
    [*_, last] = _all(stage, "ENTRYPOINT")
    form = json.loads(last)  # the exec form: a JSON array, so signals reach the program
    assert isinstance(form, list) and all(isinstance(a, str) for a in form), last
    return form


def _python_base(stage: dict) -> str:
    match = re.fullmatch(r"python:(3\.\d+)(-slim[-\w]*)?", stage["from"])
    assert match, f"expected an official python base image, got FROM {stage['from']}"
    assert match.group(1) == project_python(), \
        f"the image runs Python {match.group(1)}, the project's .python-version names {project_python()}"
    return match.group(1)


def project_python() -> str:
    """The Python minor version the project's .python-version names (pyenv's choice in the
    repository, and the images')."""
    with open(os.path.join(ROOT, ".python-version"), encoding="utf-8") as f:
        return f.read().strip()


def test_the_python_version_file_the_setup_and_the_running_python_agree():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    [call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    requires = ast.literal_eval({k.arg: k.value for k in call.keywords}["python_requires"])
    assert requires == ">=3.12"  # jax 0.11 dropped 3.11
    assert _major_minor(project_python()) >= (3, 12) and sys.version_info[:2] >= (3, 12)


def _setup_extras_and_packages() -> tuple[set[str], set[str]]:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    [call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    keywords = {k.arg: k.value for k in call.keywords}
    extras = set(ast.literal_eval(keywords["extras_require"]))
    include = ast.literal_eval(keywords["packages"].keywords[0].value)  # find_packages(include=[...])
    return extras, {p for p in include if "*" not in p}


def _installs_jax_tpu(stage: dict) -> None:
    runs = [r for r in _all(stage, "RUN") if "jax[tpu]" in r]
    assert runs, "no RUN installs jax[tpu]"
    assert all(LIBTPU_INDEX in r for r in runs), "jax[tpu] must be installed with jax's libtpu find-links"


def _installs_promptmill(stage: dict) -> set[str]:
    """Checks that the image copies what setup.py packages into /src and pip-installs it
    with known extras; returns those extras."""
    extras, packages = _setup_extras_and_packages()
    copied = set()
    for args in _all(stage, "COPY"):
        if args.startswith("--from"):
            continue
        *sources, dest = args.split()
        if dest.rstrip("/").startswith("/src"):
            copied |= {s.rstrip("/") for s in sources}
            if dest.rstrip("/") != "/src":
                copied.add(dest.rstrip("/")[len("/src/"):])
    needed = {"setup.py", "README.md"} | packages  # setup.py reads README.md
    assert "." in copied or needed <= copied, f"the image must copy {sorted(needed - copied)} to /src"
    installs = [m for r in _all(stage, "RUN") for m in re.findall(r'pip install[^&]*?"?/src\[([\w,]+)\]"?', r)]
    assert installs, "no RUN pip-installs promptmill from /src"
    wanted = set(installs[-1].split(","))
    assert wanted <= extras, f"extras {sorted(wanted - extras)} are not in setup.py's {sorted(extras)}"
    assert "tpu" in wanted
    return wanted


def _beam_pin(stage: dict) -> str:
    pins = [m for r in _all(stage, "RUN") for m in re.findall(r"apache-beam\[gcp\]==([\w.]+)", r)]
    assert pins, "the image must pin apache-beam[gcp]==BEAM_VERSION"
    return pins[-1]


def _major_minor(version: str) -> tuple[int, int]:
    return tuple(int(p) for p in version.split(".")[:2])


def test_tpu_host_image_installs_jax_tpu_and_promptmill_with_promptmill_as_entrypoint():
    [stage] = parse_dockerfile(TPU_HOST)
    _python_base(stage)
    _installs_jax_tpu(stage)
    assert {"tpu", "gcp"} <= _installs_promptmill(stage)  # gcp: plan/collect on gs:// and launching Dataflow
    assert _entrypoint(stage) == ["promptmill"]


def test_dataflow_image_boots_the_beam_sdk_of_the_installed_beam_version():
    from importlib.metadata import version

    installed = version("apache-beam")
    *helpers, final = parse_dockerfile(DATAFLOW)
    python = _python_base(final)
    sdk_stages = {s["alias"] or s["from"]: s["from"] for s in helpers}
    [(source, dest)] = [tuple(a.split()[1:]) for a in _all(final, "COPY") if a.startswith("--from=")]
    assert dest == "/opt/apache/beam" and source == "/opt/apache/beam"
    origin = next(a for a in _all(final, "COPY") if a.startswith("--from=")).split()[0][len("--from="):]
    image = sdk_stages.get(origin, origin)
    match = re.fullmatch(r"apache/beam_python(3\.\d+)_sdk:([\w.]+)", image)
    assert match, f"/opt/apache/beam must come from a Beam Python SDK image, got {image}"
    sdk_python, beam = match.groups()
    assert sdk_python == python, f"the boot program is for Python {sdk_python}, the image runs {python}"
    assert _major_minor(beam) == _major_minor(installed), \
        f"the image's Beam {beam} is not the installed apache_beam {installed}"
    assert _beam_pin(final) == beam  # the SDK in the image is the boot program's
    assert _entrypoint(final) == ["/opt/apache/beam/boot"]
    _installs_jax_tpu(final)
    assert "gcp" in _installs_promptmill(final)


def test_dataflow_image_describes_a_single_host_tpu_shape():
    *_, final = parse_dockerfile(DATAFLOW)
    env = final["vars"]
    assert (env["TPU_SKIP_MDS_QUERY"], env["TPU_HOST_BOUNDS"], env["TPU_WORKER_ID"]) == ("1", "1,1,1", "0")
    assert env["TPU_WORKER_HOSTNAMES"] == "localhost"
    chips = int(re.fullmatch(r"v\w+-(\d+)", env["TPU_ACCELERATOR_TYPE"]).group(1))
    bounds = [int(b) for b in env["TPU_CHIPS_PER_HOST_BOUNDS"].split(",")]
    assert len(bounds) == 3 and bounds[0] * bounds[1] * bounds[2] == chips


def test_launcher_and_dataflow_images_agree_on_python_and_beam():
    """Dataflow runs a job only with the launcher's Python minor version and Beam SDK, and
    the scheduled runs launch from the TPU host image."""
    [host] = parse_dockerfile(TPU_HOST)
    *_, worker = parse_dockerfile(DATAFLOW)
    assert _python_base(host) == _python_base(worker)
    assert _beam_pin(host) == _beam_pin(worker)


def test_launcher_image_is_the_tpu_host_image_plus_gcloud_kubectl_and_its_entry_script():
    [stage] = parse_dockerfile(LAUNCHER)
    assert "promptmill-tpu-host" in stage["from"]
    installs = " ".join(_all(stage, "RUN"))
    for package in ("google-cloud-cli", "kubectl", "google-cloud-cli-gke-gcloud-auth-plugin"):
        assert package in installs.split()
    [copy] = [a for a in _all(stage, "COPY") if "submit.sh" in a]
    source, dest = copy.split()
    assert os.path.isfile(os.path.join(ROOT, source)) and _entrypoint(stage) == [dest]
    assert os.access(SUBMIT_SH, os.X_OK), "COPY keeps the mode: submit.sh must be executable"


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore rules, last match wins; a pattern matching a parent matches the path."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            ignored = not negated
    return ignored


@pytest.mark.parametrize("dockerfile", [TPU_HOST, DATAFLOW, LAUNCHER])
def test_each_build_context_keeps_what_its_image_copies_and_drops_the_virtualenv(dockerfile):
    ignore_file = dockerfile + ".dockerignore"
    patterns = [line.strip() for line in open(ignore_file, encoding="utf-8")
                if line.strip() and not line.startswith("#")]
    for stage in parse_dockerfile(dockerfile):
        for args in _all(stage, "COPY"):
            if not args.startswith("--from"):
                for source in args.split()[:-1]:
                    assert not _ignored(source.rstrip("/"), patterns), f"{ignore_file} drops {source}"
    assert not _ignored("pipeline/schedule.py", patterns) or dockerfile == LAUNCHER
    for dropped in (".venv/bin/python", ".git/HEAD", "promptmill-out/run.json", "tests/test_infra.py",
                    "pipeline/__pycache__/schedule.cpython-311.pyc"):
        assert _ignored(dropped, patterns), f"{ignore_file} lets {dropped} into the build context"


# -- the launcher's entry script --------------------------------------------------------

def _fake_tools(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("promptmill", "gcloud"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "{tmp_path}/{tool}.args"\n')
        script.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_submit_sh_passes_its_arguments_to_promptmill_unchanged(tmp_path):
    args = ["submit", "dataflow", "--out", "gs://b/daily/{date}", "--prompts", "gs://b/p/*.jsonl",
            "--date", "2026-11-20T06:00:02.412345Z", "two words"]
    result = subprocess.run([SUBMIT_SH, *args], env=_fake_tools(tmp_path), capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "promptmill.args").read_text().splitlines() == args
    assert not (tmp_path / "gcloud.args").exists()  # no GKE_CLUSTER: no credentials to fetch


def test_submit_sh_fetches_the_gke_cluster_credentials_first(tmp_path):
    env = dict(_fake_tools(tmp_path), GKE_CLUSTER="promptmill", GKE_LOCATION="us-central1")
    result = subprocess.run([SUBMIT_SH, "submit", "gke"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "gcloud.args").read_text().split() == \
        ["container", "clusters", "get-credentials", "promptmill", "--location", "us-central1"]
    assert (tmp_path / "promptmill.args").read_text().split() == ["submit", "gke"]


def test_submit_sh_without_the_cluster_location_is_a_clear_error(tmp_path):
    env = dict(_fake_tools(tmp_path), GKE_CLUSTER="promptmill")
    result = subprocess.run([SUBMIT_SH, "submit", "gke"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "GKE_LOCATION" in result.stderr and "GKE_CLUSTER=promptmill" in result.stderr
    assert not (tmp_path / "promptmill.args").exists()


# -- the workflow -----------------------------------------------------------------------

class WorkflowRaised(Exception):
    pass


def _split_top_level(expression: str, separator: str) -> list[str]:
    parts, depth, quoted, current = [], 0, False, ""
    for char in expression:
        if char == '"':
            quoted = not quoted
        elif not quoted and char in "([":
            depth += 1
        elif not quoted and char in ")]":
            depth -= 1
        if char == separator and not quoted and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


def _term(term: str, scope: dict, env: dict):
    term = term.strip()
    if match := re.fullmatch(r'"([^"]*)"', term):
        return match.group(1)
    if match := re.fullmatch(r'sys\.get_env\("(\w+)"\)', term):
        assert match.group(1) in env, f"the workflow reads {match.group(1)}, which is not in its environment"
        return env[match.group(1)]
    if term == "time.format(sys.now())":
        return scope["$now"]
    if match := re.fullmatch(r'default\(map\.get\(args, "(\w+)"\), (\w+)\)', term):
        value = scope["args"].get(match.group(1))
        return scope[match.group(2)] if value is None else value
    if match := re.fullmatch(r"json\.encode_to_string\((\w+)\)", term):
        return json.dumps(scope[match.group(1)])
    if match := re.fullmatch(r'(\w+) == "([^"]*)"', term):
        return scope[match.group(1)] == match.group(2)
    if match := re.fullmatch(r"(\w+) != null", term):
        return scope[match.group(1)] is not None
    if re.fullmatch(r"[a-z_]\w*", term):
        assert term in scope, f"the workflow uses {term} before assigning it"
        return scope[term]
    raise AssertionError(f"the test's Workflows interpreter does not know the expression {term!r}")


def _value(value, scope: dict, env: dict):
    if isinstance(value, list):
        return [_value(v, scope, env) for v in value]
    if isinstance(value, dict):
        return {k: _value(v, scope, env) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        terms = [_term(t, scope, env) for t in _split_top_level(value[2:-1], "+")]
        return terms[0] if len(terms) == 1 else "".join(terms)
    return value


def _run_steps(steps: list[dict], scope: dict, env: dict, calls: list):
    """Runs steps; returns ("return", value), ("next", step name) for a jump out of
    these steps, or None when it falls off their end."""
    names = [next(iter(s)) for s in steps]
    i = 0
    while i < len(steps):
        _, body = next(iter(steps[i].items()))
        i += 1
        jump = body.get("next")
        for assignment in body.get("assign", []):
            [(var, expr)] = assignment.items()
            scope[var] = _value(expr, scope, env)
        if "call" in body:
            calls.append((body["call"], _value(body.get("args", {}), scope, env)))
        if "raise" in body:
            raise WorkflowRaised(_value(body["raise"], scope, env))
        if "return" in body:
            return "return", _value(body["return"], scope, env)
        for condition in body.get("switch", []):
            if _value(condition["condition"], scope, env):
                outcome = _run_steps(condition.get("steps", []), scope, env, calls)
                if outcome and outcome[0] == "return":
                    return outcome
                if "raise" in condition:
                    raise WorkflowRaised(_value(condition["raise"], scope, env))
                jump = condition.get("next", outcome[1] if outcome else jump)
                break
        if jump == "end":
            return None
        if jump:
            if jump not in names:
                return "next", jump
            i = names.index(jump)
    return None


def run_workflow(args, env: dict, now: str = "2026-11-20T06:00:02.412345Z"):
    """The workflow's result and its connector calls, for one execution."""
    main = yaml.safe_load(open(WORKFLOW, encoding="utf-8"))["main"]
    assert main["params"] == ["args"]
    scope = {"args": args, "$now": now}
    calls: list = []
    outcome = _run_steps(main["steps"], scope, dict(env, GOOGLE_CLOUD_PROJECT_ID="proj",
                                                     GOOGLE_CLOUD_LOCATION="us-central1"), calls)
    assert outcome and outcome[0] == "return", f"the workflow ended without returning ({outcome})"
    return outcome[1], calls


def _readme() -> str:
    return open(README, encoding="utf-8").read()


def _readme_bash_commands() -> list[str]:
    """Every command of the README's ```bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", _readme(), re.S):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            if command.strip():
                commands.append(command.strip())
    return commands


def _readme_command(prefix: str) -> list[str]:
    [command] = [c for c in _readme_bash_commands() if c.startswith(prefix)]
    return shlex.split(command)


def _flag(words: list[str], name: str) -> str:
    [value] = [w.split("=", 1)[1] for w in words if w.startswith(name + "=")]
    return value


def _workflow_env(engine: str) -> dict[str, str]:
    """The environment that the README deploys the workflow with, its shell variables
    given sample values."""
    words = _readme_command("gcloud workflows deploy")
    pairs = dict(p.split("=", 1) for p in _flag(words, "--set-env-vars").split(","))
    sample = {"$BUCKET": "bkt", "$REPO": "us-central1-docker.pkg.dev/proj/promptmill", "$TAG": "abc123",
              "$WORKER_SA": "promptmill-worker@proj.iam.gserviceaccount.com"}
    for variable, value in sample.items():
        pairs = {k: v.replace(variable, value) for k, v in pairs.items()}
    assert "$" not in "".join(pairs.values()), pairs
    if engine == "gke":
        pairs.update(ENGINE="gke", TOPOLOGY="4x4", IMAGE="us-central1-docker.pkg.dev/proj/promptmill/tpu-host:abc")
    return pairs


def test_workflow_yaml_parses_and_runs_promptmill_with_the_date_and_a_dated_out():
    text = open(WORKFLOW, encoding="utf-8").read()
    assert "--date" in text and "{date}" in text
    assert isinstance(yaml.safe_load(text)["main"]["steps"], list)


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _check_promptmill_command(words: list[str]) -> argparse.Namespace:
    from jobs.cli import build_parser

    assert words[0] == "promptmill", words
    parser = build_parser()
    assert words[1] in _subcommands(parser), f"`promptmill {words[1]}` is not a promptmill command"
    try:
        args, extra = parser.parse_known_args(words[1:])
    except SystemExit as e:
        raise AssertionError(f"promptmill's parser refuses {shlex.join(words)}") from e
    # submit hands the flags it does not know to Beam: only as --beam_option=VALUE here, and
    # only options Beam knows (promptmill refuses others, exit 2)
    beam = [e for e in extra if args.command == "submit" and re.fullmatch(r"--[a-z][a-z0-9_]*=\S+", e)]
    assert extra == beam, f"{shlex.join(words)}: flags promptmill does not know: {extra}"
    from jobs import strict

    try:
        assert strict.check_extra(args, extra) == extra
    except SystemExit as e:
        raise AssertionError(f"promptmill refuses {shlex.join(words)}: an unknown flag") from e
    assert args.command == words[1]
    return args


@pytest.mark.parametrize("engine", ["dataflow", "gke"])
@pytest.mark.parametrize("arguments,date", [({}, "2026-11-20"), (None, "2026-11-20"),
                                            ({"date": "2026-11-18"}, "2026-11-18"),
                                            ({"date": "2026-11-18T23:30:00-05:00"}, "2026-11-19")])
def test_the_workflow_runs_the_launcher_job_with_a_command_promptmill_accepts(engine, arguments, date):
    """Cloud Scheduler's execution ({} as its argument: the execution's start time), an
    execution without an argument, and a manual re-run or backfill with a date."""
    result, calls = run_workflow(arguments, _workflow_env(engine))
    [(call, args)] = [c for c in calls if c[0].startswith("googleapis.run")]
    assert call == "googleapis.run.v2.projects.locations.jobs.run"
    job = _readme_command("gcloud run jobs create")[4]
    assert args["name"] == f"projects/proj/locations/us-central1/jobs/{job}"
    [override] = args["body"]["overrides"]["containerOverrides"]
    command = override["args"]
    assert command == result["command"] and command[:2] == ["submit", engine]
    out, given = command[command.index("--out") + 1], command[command.index("--date") + 1]
    assert out == "gs://bkt/daily/{date}"
    assert schedule.resolve_out(out, given) == f"gs://bkt/daily/{date}"  # what promptmill makes of it
    assert command[command.index("--model") + 1] == "gs://bkt/models/sd-1-5"
    if engine == "dataflow":  # the workers run as promptmill-worker
        assert "--service_account_email=promptmill-worker@proj.iam.gserviceaccount.com" in command
    else:  # the pods reach GCS through Workload Identity
        assert command[command.index("--service-account") + 1] == "promptmill"
    _check_promptmill_command(["promptmill", *command])


def test_the_workflow_refuses_an_unknown_engine():
    with pytest.raises(WorkflowRaised, match='ENGINE must be dataflow or gke, got "spark"'):
        run_workflow({"engine": "spark"}, _workflow_env("dataflow"))


def test_scheduler_and_workflow_commands_of_the_readme_name_the_same_things():
    deploy = _readme_command("gcloud workflows deploy")
    workflow = deploy[3]
    assert os.path.join(ROOT, _flag(deploy, "--source")) == WORKFLOW
    scheduler = _readme_command("gcloud scheduler jobs create http")
    assert _flag(scheduler, "--uri").endswith(f"/workflows/{workflow}/executions")
    assert json.loads(json.loads(_flag(scheduler, "--message-body"))["argument"]) == {}
    assert _flag(scheduler, "--time-zone") == "Etc/UTC"
    run_job = _readme_command("gcloud run jobs create")
    assert _flag(run_job, "--image").endswith("/promptmill-submit:$TAG")
    env = _workflow_env("dataflow")
    assert env["SUBMIT_JOB"] == run_job[4] and env["ENGINE"] == "dataflow"
    reserved = [k for k in env if k.startswith(("GOOGLE_", "WORKFLOWS_"))]  # Workflows refuses these names
    assert not reserved, reserved


# -- the README -------------------------------------------------------------------------

def _readme_promptmill_commands() -> list[list[str]]:
    return [shlex.split(c) for c in _readme_bash_commands() if c.startswith("promptmill ")]


def test_readme_promptmill_commands_parse_with_promptmills_parser():
    commands = _readme_promptmill_commands()
    assert {c[1] for c in commands} >= {"submit", "generate", "run"}
    checked = 0
    for words in commands:
        try:
            args = _check_promptmill_command(words)
        except pytest.skip.Exception:
            continue
        checked += 1
        if "{date}" in args.out:  # a dated command resolves to that date's OUT
            assert schedule.resolve_out(args.out, args.date).endswith("/" + schedule.run_date(args.date))
    assert checked >= 2


def test_readme_submit_commands_parse():
    submits = [c for c in _readme_promptmill_commands() if c[1] == "submit"]
    assert {c[2] for c in submits} == {"dataflow", "gke"}
    for words in submits:
        _check_promptmill_command(words)


def test_readme_paths_exist():
    for path in sorted(set(re.findall(r"\binfra/[\w./-]*\w", "\n".join(_readme_bash_commands())))):
        assert os.path.exists(os.path.join(ROOT, path)), f"infra/README.md names {path}, which does not exist"


def test_readme_builds_every_dockerfile_with_the_repository_root_as_context():
    builds = [shlex.split(c) for c in _readme_bash_commands() if c.startswith("docker build")]
    built = {_flag_value(b, "-f") for b in builds}
    assert built == {"infra/tpu-host/Dockerfile", "infra/dataflow/Dockerfile", "infra/schedule/Dockerfile"}
    assert all(b[-1] == "." for b in builds)


def _flag_value(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def _readme_table(marker: str) -> list[list[str]]:
    """The body rows of the first table at or after ``marker``, cells without backticks."""
    lines = _readme()[_readme().index(marker):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    assert set(table[1][0]) <= set("-: "), "a Markdown table starts with a header and a rule"
    return table[2:]


def test_readme_tpu_tables_agree_with_promptmills_tpu_table():
    """The Dataflow image's shape variables and the GKE node pools of the README are those
    of the TPU slices promptmill submits to (pipeline/cloud/tpu.py)."""
    from pipeline.cloud import tpu
    dataflow_rows = _readme_table("The Dataflow image is built once per TPU shape")
    assert len(dataflow_rows) >= 6
    for shape, accelerator_type, bounds, machine in dataflow_rows:
        tpu_type, topology = shape.split()
        worker = tpu.for_dataflow(tpu_type, topology)
        assert worker.machine_type == machine, shape
        assert accelerator_type == {"v5e": "v5litepod", "v6e": "v6e"}[tpu_type] + f"-{worker.chips}"
        assert [int(b) for b in bounds.split(",")] == [int(d) for d in topology.split("x")] + [1]
    gke_rows = _readme_table("| `--tpu-type` `--topology` | node pool")
    for shape, machine, topology, nodes in gke_rows:
        tpu_type, shape_topology = shape.split()
        chosen = tpu.lookup(tpu_type, shape_topology, machine)
        assert topology == shape_topology and chosen.hosts == int(nodes) and chosen.hosts > 1, shape
    node_pool = _readme_command("gcloud container node-pools create")
    chosen = tpu.lookup("v5e", _flag(node_pool, "--tpu-topology"), _flag(node_pool, "--machine-type"))
    assert chosen.hosts == int(_flag(node_pool, "--num-nodes"))
