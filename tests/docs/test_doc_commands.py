"""Every command quoted in README.md and docs/*.md runs as written (or is listed here with the reason
it is not run).

Commands are taken from shell code blocks (continuation lines joined, ``A && B`` split, ``# ...``
comments dropped, ``VAR=value`` lines kept as environment) and from inline code spans that start
with ``python``. Each is handled by the first RULES entry whose pattern matches it:

- ``dry_run``: ``launch/run.py`` commands run as written plus ``--dry_run``: flags parse, the config
  finalizes (every key exists, every value validates), nothing starts. A trailing ``...`` (the doc
  says "more flags here") is dropped. One of them also runs for real, shortened (slow tier).
- ``help``: long-running tools (benchmarks, the planner, calibration) run as ``<tool> [<name>] --help``
  and must exit 0.
- ``run``: cheap commands run exactly as written (``$PWD`` is a temporary directory).
- ``skip``: not run; the reason is printed by test_not_run_commands_are_listed.

Quoted commands that come to one invocation (the same ``--help``, or the same ``launch/run.py`` line
dry-run in two places) run once, and a failure names every place that quotes it: a process start
costs seconds here, and most quotes are of a few tools.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from typing import NamedTuple, Optional

import pytest

from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"`(python3? [^`]+)`")
_ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(\S+)$")
_NON_SHELL = {"text", "json", "python", "toml", "yaml"}


class Command(NamedTuple):
    where: str  # file:line
    text: str
    env: tuple  # (name, value) pairs set by VAR=value lines above it in the same block


class Rule(NamedTuple):
    pattern: str
    action: str  # dry_run | help | run | skip
    reason: str
    slow: bool = False


RULES = [
    Rule(r"^python3 -m venv|^\. \.venv/bin/activate$|^pip install", "skip",
         "installs packages (needs the network); CI installs the same way"),
    Rule(r"python -m pytest", "skip", "runs the test suite itself"),
    Rule(r"python -m laminar_jax\.docs_gen", "skip",
         "rewrites docs/CONFIG.md; tests/docs/test_config_reference.py checks its output instead"),
    Rule(r"^ray start", "skip", "joins a multi-host Ray cluster"),
    Rule(r"launch/plan\.py --config=my_sim_config\.py", "skip", "needs the user's own config file"),
    Rule(r"launch/bench\.py learner --memory-plan .*--preset", "run",
         "compiles a 7B gradient pass on abstract shapes (~20-40 s)", slow=True),
    Rule(r"launch/bench\.py --help$", "run", "prints the list of benchmarks"),
    Rule(r"launch/bench\.py", "help", "benchmarks run for minutes; see docs/BENCHMARKS.md"),
    Rule(r"launch/plan\.py", "help", "the planner simulates minutes of a cluster"),
    Rule(r"-m laminar_jax\.sim\.calibrate", "help", "needs the user's benchmark JSON lines"),
    Rule(r"-m laminar_jax\.sim\.cpu_check", "help", "check replays a captured e2e run"),
    Rule(r"-m laminar_jax\.benchmarks\.e2e_capture", "help", "runs the e2e bench (minutes)"),
    Rule(r"-m laminar_jax\.benchmarks\.relay", "help", "the relay benchmark runs for minutes; see docs/BENCHMARKS.md"),
    Rule(r"-m laminar_jax\.relay\.worker", "skip", "a relay worker process: the runtime starts it and writes its key on stdin"),
    Rule(r"-m laminar_jax\.runtime\.process_fleet", "skip",
         "a rollout server process: the runtime starts it with its pipes and sends its arguments down one"),
    Rule(r"launch/sft\.py .*(\.\.\.|<)", "help", "placeholder arguments (the user's config and output directory)"),
    Rule(r"launch/sft\.py", "run", "60 supervised steps of the tiny model"),
    Rule(r"launch/eval\.py .*<", "help", "placeholder checkpoint (a run directory of the user's; "
         "tests/eval/test_eval_run.py runs it on a real one)"),
    Rule(r"launch/run\.py .*--dry_run", "run", "validates a config and exits"),
    Rule(r"launch/run\.py", "dry_run", "a full run takes minutes (or a GPU, a cluster, a downloaded model)"),
]


def _shell_lines(lang: str, body: str) -> list[tuple[int, str]]:
    """(offset, line) of a fenced block's commands, continuation lines joined."""
    out, buf, start = [], "", 0
    for i, raw in enumerate(body.splitlines()):
        line = raw.rstrip()
        if not buf:
            start = i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, (buf + line).strip()))
        buf = ""
    if lang == "":  # unlabelled blocks hold output too: keep command-looking lines only
        out = [(i, c) for i, c in out if re.match(r"(python3? |pip |ray |[A-Z_]+=)", c)]
    return [(i, c) for i, c in out if c and not c.startswith("#")]


def _strip_comment(cmd: str) -> str:
    return re.split(r"\s+#\s", cmd, maxsplit=1)[0].strip()


def extract(doc: str) -> list[Command]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    found: list[Command] = []
    for m in _FENCE.finditer(text):
        lang = m.group(1).lower()
        if lang in _NON_SHELL:
            continue
        base_line = text[:m.start(2)].count("\n") + 1
        env: list[tuple[str, str]] = []
        for offset, line in _shell_lines(lang, m.group(2)):
            for part in (_strip_comment(p) for p in line.split(" && ")):
                a = _ASSIGN.match(part)
                if a:
                    env.append((a.group(1), a.group(2)))
                elif part:
                    found.append(Command(f"{doc}:{base_line + offset}", part, tuple(env)))
    fenced = {m.span() for m in _FENCE.finditer(text)}
    for m in _INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in fenced):
            continue
        found.append(Command(f"{doc}:{text[:m.start()].count(chr(10)) + 1}", m.group(1).strip(), ()))
    return found


def rule_for(cmd: str) -> Optional[Rule]:
    return next((r for r in RULES if re.search(r.pattern, cmd)), None)


COMMANDS = [c for doc in DOCS for c in extract(doc)]
RUNNABLE = [c for c in COMMANDS if rule_for(c.text) and rule_for(c.text).action != "skip"]


def invocation(cmd: Command) -> tuple:
    """What running a quoted command executes: its action, argv and environment. A `run` command
    that writes under $PWD (its own temporary directory) is its own invocation."""
    rule = rule_for(cmd.text)
    if rule.action == "help":
        return ("help", tuple(_help_argv(cmd.text)[1:]), cmd.env)
    if rule.action == "dry_run":
        return ("dry_run", re.sub(r"\s+\.\.\.$", "", cmd.text), cmd.env)
    return ("run", cmd.where if "$PWD" in cmd.text else "", cmd.text, cmd.env)


def _grouped(cmds: list[Command]) -> list[list[Command]]:
    groups: dict[tuple, list[Command]] = {}
    for c in cmds:
        groups.setdefault(invocation(c), []).append(c)
    return list(groups.values())


def _params(groups):
    out = []
    for cmds in groups:
        slow = rule_for(cmds[0].text).slow
        more = f"+{len(cmds) - 1}" if len(cmds) > 1 else ""
        out.append(pytest.param(cmds, id=f"{cmds[0].where}{more}", marks=[pytest.mark.slow] if slow else []))
    return out


def _argv(cmd: str, tmp_path) -> list[str]:
    cmd = cmd.replace("$PWD", str(tmp_path))
    argv = shlex.split(cmd)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def _help_argv(cmd: str) -> list[str]:
    argv = shlex.split(cmd)
    tool = argv[:3] if argv[1] == "-m" else argv[:2]
    rest = argv[len(tool):]
    name = [rest[0]] if "bench.py" in tool[-1] and rest and re.fullmatch(r"[a-z_0-9]+", rest[0]) else []
    return [sys.executable, *tool[1:], *name, "--help"]


def _run(argv, env_pairs, tmp_path, timeout):
    env = child_env(JAX_PLATFORMS="cpu", **dict(env_pairs))
    argv = [a.replace("$M", env.get("M", "$M")) for a in argv]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_commands_were_found_and_every_one_has_a_rule():
    assert len(COMMANDS) >= 15, [c.text for c in COMMANDS]
    unclassified = [f"{c.where}: {c.text}" for c in COMMANDS if rule_for(c.text) is None]
    assert not unclassified, "add a RULES entry (run it, or say why not):\n" + "\n".join(unclassified)


def test_not_run_commands_are_listed(capsys):
    skipped = [(c, rule_for(c.text)) for c in COMMANDS if rule_for(c.text).action in ("skip", "help")]
    with capsys.disabled():
        print("\nquoted commands not run as written:")
        for c, r in skipped:
            how = "only --help" if r.action == "help" else "not run"
            print(f"  {c.where}: {c.text[:90]}  [{how}: {r.reason}]")
    assert all(r.reason for _, r in skipped)


def test_every_runnable_command_is_in_exactly_one_invocation():
    groups = _grouped(RUNNABLE)
    assert sorted(c.where + c.text for g in groups for c in g) == sorted(c.where + c.text for c in RUNNABLE)
    assert all(len({invocation(c) for c in g}) == 1 for g in groups)


@pytest.mark.parametrize("cmds", _params(_grouped(RUNNABLE)))
def test_quoted_command_runs(cmds, tmp_path):
    cmd = cmds[0]
    where = ", ".join(c.where for c in cmds)  # every place that quotes this invocation
    rule = rule_for(cmd.text)
    if rule.action == "help":
        res = _run(_help_argv(cmd.text), cmd.env, tmp_path, 120)
        assert res.returncode == 0, f"{where}: {res.stderr[-2000:]}"
        assert len(res.stdout.strip()) > 100, f"{where}: --help printed almost nothing: {res.stdout!r}"
        return
    text = re.sub(r"\s+\.\.\.$", "", cmd.text)
    argv = _argv(text, tmp_path)
    if rule.action == "dry_run":
        argv.append("--dry_run")
    res = _run(argv, cmd.env, tmp_path, 300 if rule.slow else 180)
    assert res.returncode == 0, f"{where}: `{cmd.text}` exited {res.returncode}:\n{res.stderr[-3000:]}"
    if rule.action == "dry_run" or "--dry_run" in argv:
        assert res.stdout.lstrip().startswith("{") and '"runtime"' in res.stdout
    if "--memory-plan" in argv:
        assert re.search(r"^(FITS|DOES NOT FIT): ", res.stdout, re.MULTILINE), res.stdout[-1000:]


@pytest.mark.slow
def test_quickstart_demo_runs_and_its_eval_figure_moves(tmp_path):
    """README's quickstart command itself, whole (~2 min on 2 cores): every step runs, and the eval
    rounds' graded reward (eval.jsonl 'reward', the summary's eval_reward) ends above the warm-started
    policy's (the round before the first step). Measured on a 2-core AMD EPYC, load 11-21: 0.224 ->
    0.360, 0.356 and 0.358 (steps 0 and 80); the step-80 round 0.356-0.38 over seven runs. The
    step-20 round, the baseline before, varied 0.22-0.33 and once left a rise of only 0.022."""
    quick = next(c for c in COMMANDS if c.where.startswith("README.md") and
                 c.text == "python launch/run.py --config=configs/demo.py")
    argv = _argv(quick.text, tmp_path) + [f"--config.runtime.run_dir={tmp_path / 'run'}",
                                          "--config.runtime.progress=false", "--config.runtime.timeline=false"]
    res = _run(argv, (), tmp_path, 900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Timeout is disabled" not in res.stderr  # math_verify's notice (data/rewards.py filters it)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").open()]
    rounds = [r["metrics"]["overall"] for r in records]
    assert summary["steps"] == 80 and [r["step"] for r in records] == [0, 20, 40, 60, 80], (summary["steps"], records)
    assert rounds[-1]["reward"] >= rounds[0]["reward"] + 0.06, [r["reward"] for r in rounds]
