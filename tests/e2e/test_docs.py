"""The docs cannot drift: the configuration reference is the generator's output, and every command shown is run.

Every fenced ```sh block of README.md and docs/*.md is read as a little script: `\\` continuations joined, prompts
and `# comments` dropped. Each of its command lines must be one of:

- `python -m andrea SUB ...`: run here, in process (`andrea.cli.main`), in block order, against fixtures made
  once per module (a tiny trained run, a small corpus, a policy file); the doc's placeholders and example paths
  map to them through PLACEHOLDERS, the one table of rewrites, and one check per subcommand (CHECKS) asserts
  something specific about what the command did;
- `make TARGET ...`: the target exists, and its recipe runs an andrea command that a block here runs (MAKE_TARGETS);
- `python bench/X.py ...`, `python -m andrea.kernels.compile_check ...`: every flag shown is one the script's
  argparse defines, and BENCH_TESTS names the test that runs the script;
- an external tool (EXTERNAL): the named tests exist and exercise what the doc claims of it; `jq` is run here on
  a ledger with superseded entries.

A command of any other kind fails the collection test, so a doc cannot gain a command nobody accounts for.
```text blocks of `python -m andrea` lines are grammars (`[optional]` brackets): every flag they show must exist in
that subcommand's parser, and the README's synopsis must show every subcommand and every flag.
Config files, units, YAML, SLURM scripts and Python are in ```toml / ```ini / ```yaml / ```bash / ```python
blocks and are not commands; the README's corpus example (```toml) is the configuration `prepare` runs with.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gzip
import io
import json
import re
import runpy
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from andrea import cli
from andrea.config import schema as config, doc as configdoc
from andrea.config.corpus import SourceConfig
from andrea.control.observe import plots
from andrea.rundir import ledger as ledger_mod
from andrea.rundir import checkpoint as ckpt, names
from tests.runs import ROOT, ledger, seed_data, train

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIXTURE_STEPS = 40  # the tiny run: checkpoints every 10 steps, evals every 10, keep_last 5 (steps 0..40)


# --- the docs as blocks and commands --------------------------------------------------------------------------------

@dataclasses.dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    out, lang, start, body = [], None, 0, []
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), i, []
            else:
                out.append(Block(doc, start, lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{doc}: unclosed code block at line {start}"
    return out


def all_blocks(lang: str) -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc) if b.lang == lang]


def commands(block: Block) -> list[list[str]]:
    """The block's command lines as argv lists: continuations and multi-line quotes joined, comments dropped."""
    out, pending = [], ""
    for line in block.text.splitlines():
        if not pending and line.lstrip().startswith("$ "):
            line = line.lstrip()[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote that closes on a later line (jq programs)
            pending += "\n"
            continue
        pending = ""
        if argv:
            out.append(argv)
    assert not pending, f"{block.where}: unterminated command {pending!r}"
    return out


def kind(argv: list[str]) -> str:
    if argv[:3] == ["python", "-m", "andrea"]:
        return "andrea"
    if argv[:3] == ["python", "-m", "andrea.kernels.compile_check"] or (
            len(argv) > 1 and argv[0] in ("python", "bash") and argv[1].startswith("bench/")):
        return "bench"
    if argv[0] == "make":
        return "make"
    if argv[0] in EXTERNAL:
        return "external"
    return "unaccounted"


def sh_commands() -> list[tuple[Block, list[str]]]:
    return [(b, argv) for b in all_blocks("sh") for argv in commands(b)]


# --- the one table of rewrites --------------------------------------------------------------------------------------

# What each placeholder (capitals) or example path of the docs means here. Values are fixture names, resolved per
# block by Workspace.resolve: "run" is a copy of the tiny trained run (per block, so commands may write into it),
# "new:NAME" a path that does not exist yet (made by the command that names it, used by the ones after it).
PLACEHOLDERS = {
    "RUN_DIR": "run",
    "runs/andrea-12m": "run",
    "DIR": "new:export",          # export --out DIR
    "NEW_DIR": "new:branch",      # branch --to NEW_DIR, then compare RUN_DIR NEW_DIR
    "runs/big": "new:big",        # prepare --run-dir runs/big, then train --run-dir runs/big
    "S": "step",                  # a retained checkpoint's step of the run
    "TEXT": "text",               # a prompt
    "NEW.toml": "policy",         # docs/operating.md's [policy] example
    "corpus.toml": "corpus_toml",  # the README's corpus example, its paths under /data/ mapped to the small corpus
    "loss.png": "new:loss.png",
    "compare.png": "new:compare.png",
    "/data/": "corpus_dir",       # (a path prefix inside corpus.toml)
    "hellaswag_val.jsonl": "tasks",  # eval --tasks: the shipped tests/tasks/memorized.jsonl (nothing downloaded)
}
# The only other rewrite: `train` and `prepare` with `--preset andrea-12m|andrea-120m` run as `--preset andrea-tiny`
# with `--steps` two past the run's newest checkpoint (a CPU test cannot train the big presets). `info --preset
# andrea-120m ...` runs as written.
BIG_PRESETS = ("andrea-12m", "andrea-120m")
EXTRA_STEPS = 2

# make targets shown in the docs: what their recipe runs, and why that is covered.
MAKE_TARGETS = {
    "train": "-m andrea train --preset $(PRESET) --run-dir $(RUN_DIR) $(ARGS)",  # the README's first run runs it
    "test": "-m pytest",  # CI itself (.ci/run)
    "quick": "-m pytest",  # the unit tests of `make test`, for the development loop
    "gpu-offline": "-m gpu_offline",  # the tests marked gpu_offline: CI runs it after `make test` (.ci/run)
    "chaos": "bench/chaos.py",  # the long chaos run; its short version runs in the suite (BENCH_TESTS)
    "campaign": "bench/campaign.py --seeds $(SEEDS)",  # the long campaign; two seeds run in the suite (BENCH_TESTS)
}

# bench scripts shown in the docs -> the test that runs them (each test's source names its script).
BENCH_TESTS = {
    "bench/checkpoint.py": "tests/e2e/test_bench_smoke.py::test_checkpoint_bench_reports_every_method",
    "bench/checkpoint_e2e.py":
        "tests/e2e/test_bench_checkpoint_e2e.py::test_end_to_end_bench_runs_both_cadences_and_counts_their_checkpoints",
    "bench/guard.py": "tests/e2e/test_guard_run.py::test_defaults_never_trigger_on_the_tiny_whole_schedule",  # -m slow
    "bench/guard_series.py": "tests/e2e/test_guard_run.py::test_the_issues_healthy_seeds_raise_no_alarm_in_their_warm_up",
    "bench/train.py": "tests/e2e/test_bench_smoke.py::test_train_bench_runs_both_loops_in_parity",
    "bench/clip.py": "tests/e2e/test_bench_smoke.py::test_clip_bench_quick_prints_a_row_per_clip_with_the_gradient_norms",
    "bench/memory.py": "tests/e2e/test_microbatch.py::test_the_memory_bench_runs_and_prints_its_table",
    "bench/prepare.py": "tests/e2e/test_bench_prepare.py::test_the_prepare_bench_prints_its_table_with_a_verdict",
    "bench/kernels.py": "tests/e2e/test_bench_smoke.py::test_kernel_bench_runs_every_kernel_on_tiny_shapes",
    "andrea/kernels/compile_check.py":
        "tests/unit/kernels/test_compile.py::test_every_kernel_compiles_for_every_arch_within_its_limits",
    "bench/audit.py": "tests/e2e/test_bench_smoke.py::test_audit_bench_times_both_variants_and_the_in_process_audit",
    "bench/verify_tokens.py": "tests/e2e/test_bench_smoke.py::test_verify_tokens_bench_prints_its_cost_per_gb",
    "bench/zero_dist.py": "tests/e2e/test_bench_smoke.py::test_zero_dist_bench_reports_the_share_of_a_step_in_collectives",
    "bench/mixture.py": "tests/e2e/test_bench_smoke.py::test_mixture_bench_compares_each_policy_with_uniform",
    "bench/gpu_train.py": "tests/e2e/test_gpu_check.py::test_the_selftest_runs_every_part_into_one_results_directory",
    "bench/peer.py": "tests/e2e/test_gpu_check.py::test_the_selftest_runs_every_part_into_one_results_directory",
    "bench/chaos.py":
        "tests/e2e/test_chaos.py::test_the_chaos_run_reaches_its_target_with_the_fault_free_bytes_and_reports_every_fault",
    "bench/recipe.py": "tests/e2e/test_bench_smoke.py::test_recipe_bench_quick_prints_the_sweeps_and_the_anchors",
    "bench/anytime.py":
        "tests/e2e/test_bench_smoke.py::test_anytime_bench_quick_prints_an_anneal_a_cosine_and_an_average_at_each_point",
    "bench/campaign.py": "tests/e2e/test_campaign.py::test_two_fixed_seeds_hold_against_the_perfect_machine",
}

# External tools shown in ```sh blocks -> the tests that exercise what the docs claim of them.
EXTERNAL = {
    "tensorboard": ["tests/e2e/test_tensorboard.py::test_tensorboard_scalars_equal_the_ledger_across_a_resume"],
    "torchrun": ["tests/e2e/test_distributed.py::test_two_ranks_follow_one_process_and_write_one_truth",
                 "tests/e2e/test_distributed.py::test_two_launchers_as_two_nodes_are_the_same_run_and_a_signal_to_one_"
                 "worker_stops_both",
                 "tests/e2e/test_distributed.py::test_two_nodes_on_separate_disks_write_the_shared_runs_bytes_on_node_0_"
                 "alone"],
    "jq": ["tests/e2e/test_docs.py::test_the_ledger_snippets_give_the_effective_history"],
}


# --- fixtures -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(prepared, tmp_path_factory):
    """A tiny trained run: steps 0..40, a checkpoint and a validation every 10 steps."""
    run = seed_data(prepared, tmp_path_factory.mktemp("docs") / "run")
    result = train(run, "--steps", str(FIXTURE_STEPS), "--checkpoint-every", "10", "--set", "train.eval_every=10")
    assert result.returncode == 0, result.stderr
    return run


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Small files for the README's three sources: text (gzipped, nested), JSON lines (gzipped), parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("corpus")
    lines = [line for line in (ROOT / "andrea" / "config/schema.py").read_text().splitlines() if line.strip()]
    (root / "web" / "a").mkdir(parents=True)
    for i in range(3):
        (root / "web" / "a" / f"page{i}.txt.gz").write_bytes(gzip.compress("\n".join(lines[i::3]).encode()))
    with gzip.open(root / "papers.jsonl.gz", "wt") as f:
        for i in range(0, len(lines), 20):
            f.write(json.dumps({"body": "\n".join(lines[i:i + 20]), "id": i}) + "\n")
    (root / "wiki").mkdir()
    pq.write_table(pa.table({"text": ["\n".join(lines[i:i + 10]) for i in range(0, len(lines), 10)]}),
                   root / "wiki" / "part0.parquet")
    return root


def readme_corpus_example() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Your own data", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]


def policy_example() -> str:
    operating = (ROOT / "docs" / "operating.md").read_text()
    return operating.split("A policy file holds one `[policy]` table:", 1)[1].split("```toml\n", 1)[1].split("```")[0]


class Workspace:
    """One block's fixtures: placeholders resolved to paths under `root`, made when first named."""

    def __init__(self, root: Path, run: Path, corpus: Path):
        self.root, self.run_template, self.corpus = root, run, corpus
        self.made: dict[str, str] = {}

    def resolve(self, placeholder: str) -> str:
        if placeholder in self.made:
            return self.made[placeholder]
        name = PLACEHOLDERS[placeholder]
        if name == "run":
            value = self.root / "run"
            if not value.exists():
                shutil.copytree(self.run_template, value, ignore=shutil.ignore_patterns("train.lock", "train.pid"))
        elif name.startswith("new:"):
            value = self.root / name[4:]
        elif name == "step":
            value = ckpt.list_checkpoints(self.run_template)[-2][0]  # retained, not the newest
        elif name == "text":
            value = "def "
        elif name == "policy":
            value = self.root / "NEW.toml"
            value.write_text(policy_example())
        elif name == "corpus_toml":
            value = self.root / "corpus.toml"
            value.write_text(readme_corpus_example().replace("/data/", self.resolve("/data/")))
        elif name == "corpus_dir":
            value = f"{self.corpus}/"
        elif name == "tasks":
            value = ROOT / "tests" / "tasks" / "memorized.jsonl"
        else:
            raise AssertionError(f"no fixture {name!r}")
        for p in {"RUN_DIR", "runs/andrea-12m"} if name == "run" else {placeholder}:
            self.made[p] = str(value)
        return str(value)

    def argv(self, argv: list[str]) -> tuple[list[str], bool]:
        """`python -m andrea ...` as cli.main's argv, placeholders resolved; and whether stdout went to /dev/null."""
        args, quiet = [], False
        it = iter(argv[3:])
        for a in it:
            if a == ">":
                quiet = next(it) == "/dev/null" or pytest.fail(f"unexpected redirect in {argv}")
                continue
            args.append(self.resolve(a) if a in PLACEHOLDERS else a)
        if args[0] in ("train", "prepare") and "--preset" in args and args[args.index("--preset") + 1] in BIG_PRESETS:
            args[args.index("--preset") + 1] = "andrea-tiny"  # a CPU test cannot train the big presets
            if args[0] == "train":
                run_dir = Path(args[args.index("--run-dir") + 1])
                steps = [s for s, _ in ckpt.list_checkpoints(run_dir)] if run_dir.is_dir() else []
                stop = str((steps[-1] if steps else 0) + EXTRA_STEPS)
                if "--steps" in args:
                    args[args.index("--steps") + 1] = stop
                else:
                    args += ["--steps", stop]
        return args, quiet


def run_in_process(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(args)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


# --- what each andrea command must have done ------------------------------------------------------------------------

def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def check_train(args, out, err, block):
    run_dir = Path(flag(args, "--run-dir"))
    newest = ckpt.list_checkpoints(run_dir)[-1]
    assert newest[0] == int(flag(args, "--steps")), "the final step is checkpointed"
    assert ledger_mod.history(ledger(run_dir))[-1]["step"] == newest[0]


def check_prepare(args, out, err, block):
    manifest = json.loads((Path(flag(args, "--run-dir")) / "data" / "manifest.json").read_text())
    data = tomllib.loads(Path(flag(args, "--config")).read_text())["data"]
    assert sorted(manifest["arms"]) == sorted([*data["arms"], *(s["name"] for s in data["sources"])])
    assert all(a["complete"] and a["train_tokens"] > 0 for a in manifest["arms"].values()), manifest["arms"]


def check_verify(args, out, err, block):
    verified = [line for line in out.splitlines() if line.startswith("ok ") and "checksum=verified" in line]
    assert len(verified) == len(ckpt.list_checkpoints(args[1])) > 0 and not err, out


def check_sample(args, out, err, block):
    prompt = flag(args, "--prompt")
    assert out.startswith(prompt) and len(out) > len(prompt) + 1, out


def check_status(args, out, err, block):
    step = ledger_mod.history(ledger(Path(args[1])))[-1]["step"]
    if "--json" not in args:  # the human view: the state, then the step
        assert out.splitlines()[0] == f"{args[1]}: stopped (not running)" and f"step      {step:,}" in out, out
        return
    status = json.loads(out)
    assert status["step"] == step
    assert isinstance(status["loss_ema"], float) and status["state"] == "stopped", status


def check_plot(args, out, err, block):
    assert Path(flag(args, "--out")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_info(args, out, err, block):
    info = json.loads(out)
    preset = flag(args, "--preset")
    sizes = {"andrea-120m": (120_445_440, 1_445_345_288), "andrea-12m": (12_723_200, 152_678_408)}  # the README's
    assert (info["n_params"], info["checkpoint_bytes"]) == sizes[preset]
    shown = re.search(r"# (device memory .*)", block.text[block.text.index(" ".join(["info", *args[1:]])):], re.S)
    if shown:  # the output the doc shows under the command is what it prints
        assert err.split() == shown.group(1).replace("#", " ").split(), err


def check_export(args, out, err, block):
    out_dir = Path(flag(args, "--out"))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out_dir.iterdir()}
    assert (out_dir / "tokenizer.json").read_bytes() == (Path(args[1]) / "tokenizer.json").read_bytes()


def check_pivot(args, out, err, block):
    run_dir, policy = Path(args[1]), tomllib.loads(Path(flag(args, "--policy")).read_text())["policy"]
    pivot = ledger(run_dir)[-1]
    assert pivot["event"] == "pivot" and (pivot["floors"], pivot["caps"]) == (policy["floors"], policy["caps"])
    assert (run_dir / pivot["archived"] / ".state.json").exists()  # the finished phase's sidecars, archived
    assert tomllib.loads((run_dir / "run.toml").read_text())["policy"]["floors"] == policy["floors"]


def check_branch(args, out, err, block):
    new = Path(flag(args, "--to"))
    assert (new / names.checkpoint_name(int(flag(args, "--step")))).exists()
    assert [e["event"] for e in ledger(new) if "event" in e][-1] == "branch"


def check_compare(args, out, err, block):
    assert "branch point: step" in out, out
    if "--out" in args:
        assert Path(flag(args, "--out")).read_bytes()[:4] == b"\x89PNG"


def check_eval(args, out, err, block):
    fields = out.split()
    n = sum(1 for line in Path(flag(args, "--tasks")).read_text().splitlines() if line.strip())
    assert fields[:4] == ["step", str(ckpt.list_checkpoints(args[1])[-1][0]), "examples", str(n)], out
    assert all(0.0 <= float(fields[fields.index(k) + 1]) <= 1.0 for k in ("acc", "acc_norm", "acc_norm_chars")), out


CHECKS = {"train": check_train, "prepare": check_prepare, "verify": check_verify, "sample": check_sample,
          "status": check_status, "plot": check_plot, "info": check_info, "export": check_export,
          "pivot": check_pivot, "branch": check_branch, "compare": check_compare, "eval": check_eval}


# --- 1. the configuration reference ---------------------------------------------------------------------------------

def test_the_config_reference_matches_the_dataclasses():
    text = configdoc.REFERENCE.read_text()
    assert configdoc.BEGIN in text and configdoc.END in text
    assert configdoc.splice(text, configdoc.render()) == text, (
        "docs/configuration.md's configuration reference is stale: run `python -m andrea.config.doc --write`")
    assert configdoc.main(["--check"]) == 0


def test_every_key_of_every_section_has_a_row_with_type_default_and_meaning():
    tables, current = {}, None
    for line in configdoc.render().splitlines():
        if line.startswith("#### `"):
            current = tables.setdefault(line.strip("#` ").strip("[]"), [])
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            assert len(cells) == 4 and all(cells), line
            current.append(cells[0].strip("`"))
    expected = {s: [f.name for f in dataclasses.fields(c)] for s, c in config.section_types().items()}
    expected["data.sources"] = [f.name for f in dataclasses.fields(SourceConfig)]
    assert tables == expected
    assert "| `lr` | float | `0.0006` | Peak learning rate" in configdoc.render()


def test_a_field_without_a_docstring_is_refused():
    source = "class X:\n    a: int = 1\n    \"\"\"Documented.\"\"\"\n    b: int = 2\n"
    docs = configdoc.class_docs(source)
    assert [(f.name, f.doc) for f in docs["X"][1]] == [("a", "Documented."), ("b", "")]

    @dataclasses.dataclass
    class X:
        a: int = 1
        b: int = 2

    with pytest.raises(ValueError, match=r"X\.b has no docstring"):
        configdoc._table("[x]", "", X, docs)


# --- 2. every command shown -----------------------------------------------------------------------------------------

def test_every_command_shown_is_accounted_for():
    found = sh_commands()
    assert found, "no ```sh blocks found"
    bad = [f"{b.where}: {shlex.join(argv)}" for b, argv in found if kind(argv) == "unaccounted"]
    assert not bad, "commands no test accounts for (run them in tests/e2e/test_docs.py or tag the block):\n" + \
        "\n".join(bad)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250, "the README is the front door: <= 250 lines"


ANDREA_BLOCKS = [b for b in all_blocks("sh") if any(kind(a) == "andrea" for a in commands(b))]


@pytest.mark.parametrize("block", ANDREA_BLOCKS, ids=[b.where for b in ANDREA_BLOCKS])
def test_the_andrea_commands_of_a_block_run(block, tiny_run, corpus_dir, tmp_path):
    ws = Workspace(tmp_path, tiny_run, corpus_dir)
    for argv in commands(block):
        if kind(argv) != "andrea":
            continue
        args, _ = ws.argv(argv)
        rc, out, err = run_in_process(args)
        assert rc == 0, f"{block.where}: {shlex.join(argv)} -> {shlex.join(args)}: exit {rc}\n{err[-3000:]}"
        assert args[0] in CHECKS, f"{block.where}: no check for `andrea {args[0]}`: add one to CHECKS"
        CHECKS[args[0]](args, out, err, block)


def _makefile_targets() -> dict[str, str]:
    """Each Makefile target's recipe."""
    targets, current = {}, None
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([\w.$()/-]+):", line)
        if m:
            current = m.group(1)
            targets.setdefault(current, "")
        elif line.startswith("\t") and current is not None:
            targets[current] += line.strip() + "\n"
    return targets


def test_the_make_commands_shown_exist_and_run_what_is_covered():
    targets = _makefile_targets()
    andrea_argv = [argv for _, argv in sh_commands() if kind(argv) == "andrea"]
    shown = [(b, argv) for b, argv in sh_commands() if kind(argv) == "make"]
    assert shown
    for b, argv in shown:
        target = argv[1] if len(argv) > 1 else "train"
        assert target in targets and target in MAKE_TARGETS, f"{b.where}: make {target}"
        assert MAKE_TARGETS[target] in targets[target], targets[target]
        variables = dict(a.split("=", 1) for a in argv[2:])
        if target == "train":
            assert any(a[3:5] == ["train", "--preset"] and "--run-dir" in a for a in andrea_argv), \
                "make train's andrea command is run by a block"
            if "ARGS" in variables:  # what ARGS adds is a valid train command line
                cli.build_parser().parse_args(["train", "--run-dir", "x", *shlex.split(variables["ARGS"])])
            assert (ROOT / "andrea" / "presets" / f"{variables.get('PRESET', 'andrea-12m')}.toml").exists()
        if target == "quick":  # the development loop's files exist (pytest would stop at a missing one)
            quick = re.search(r"^QUICK \?= ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)
            paths = quick.group(1).replace("\\\n", " ").split()
            assert paths and all((ROOT / p).exists() for p in paths), paths


def _argparse_options(script: Path) -> set[str]:
    """The option strings of every add_argument call in a script (what its --help lists)."""
    options = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            options |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return options | {"-h", "--help"}


def _test_exists(test_id: str) -> str:
    path, name = test_id.split("::")
    source = (ROOT / path).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"{test_id}: no such test")


def test_the_bench_commands_shown_have_their_flags_and_a_test():
    shown = [(b, argv) for b, argv in sh_commands() if kind(argv) == "bench"]
    assert shown
    for b, argv in shown:
        script = ("andrea/kernels/compile_check.py" if argv[1] == "-m" else argv[1])
        options = _argparse_options(ROOT / script)
        flags = [a.strip("[]") for a in argv[2:] if a.strip("[]").startswith("--")]
        unknown = [f for f in flags if f not in options]
        assert not unknown, f"{b.where}: {script} has no {unknown}"
        assert script in BENCH_TESTS, f"{b.where}: which test runs {script}? (BENCH_TESTS)"
        name = "compile_check" if "compile_check" in script else script
        assert name in _test_exists(BENCH_TESTS[script]), f"{BENCH_TESTS[script]} does not run {script}"


def test_the_external_tools_shown_are_exercised_by_named_tests():
    shown = {argv[0] for _, argv in sh_commands() if kind(argv) == "external"}
    assert shown == set(EXTERNAL), "EXTERNAL lists exactly the external tools the docs show"
    for tool, tests in EXTERNAL.items():
        for test_id in tests:
            _test_exists(test_id)


def _subparsers() -> dict:
    parser = cli.build_parser()
    [action] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return action.choices


def _options(sub) -> set[str]:
    return {o for a in sub._actions if a.help != "==SUPPRESS==" for o in a.option_strings if o.startswith("--")} - {
        "--help"}


def _grammar_lines(block: Block) -> list[str]:
    out = []
    for line in block.text.splitlines():
        if line.startswith("python -m andrea "):
            out.append(line.split("  #")[0])
        elif line.startswith(" ") and out:
            out[-1] += " " + line.strip().split("  #")[0]
    return out


def test_the_grammars_shown_match_the_parser():
    subs = _subparsers()
    grammars = [b for b in all_blocks("text") if _grammar_lines(b)]
    assert grammars
    for b in grammars:
        for line in _grammar_lines(b):
            sub = line.split()[3]
            assert sub in subs, f"{b.where}: no subcommand {sub!r}"
            unknown = set(re.findall(r"--[a-z][a-z-]*", line)) - _options(subs[sub])
            assert not unknown, f"{b.where}: `andrea {sub}` has no {sorted(unknown)}"
    [synopsis] = [b for b in blocks(ROOT / "README.md") if b.lang == "text" and _grammar_lines(b)]
    lines = {line.split()[3]: line for line in _grammar_lines(synopsis)}
    assert set(lines) == set(subs), "the README's synopsis shows every subcommand"
    for sub, parser in subs.items():
        missing = _options(parser) - set(re.findall(r"--[a-z][a-z-]*", lines[sub]))
        assert not missing, f"README synopsis: `andrea {sub}` does not show {sorted(missing)}"


# --- the ledger snippets of docs/formats.md -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def superseded_run(tiny_run, tmp_path_factory):
    """The tiny run after a crash that lost its newest checkpoint: resumed at 30 and run again to 40, so its ledger
    holds the first process's entries 31..40 (and its eval at 40) superseded by the second's."""
    run = tmp_path_factory.mktemp("ledger") / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("train.lock", "train.pid"))
    for p in run.glob(f"step_{FIXTURE_STEPS:06d}.*"):
        p.unlink()
    rc, _, err = run_in_process(["train", "--preset", "andrea-tiny", "--run-dir", str(run), "--steps",
                                 str(FIXTURE_STEPS)])
    assert rc == 0, err
    entries = ledger(run)
    assert len([e for e in entries if "event" not in e]) > len(ledger_mod.history(entries)) == FIXTURE_STEPS
    return run


def _snippet(lang: str, needle: str) -> Block:
    [block] = [b for b in blocks(ROOT / "docs" / "formats.md") if b.lang == lang and needle in b.text]
    return block


def test_the_ledger_snippets_give_the_effective_history(superseded_run, tmp_path):
    if shutil.which("jq") is None:
        pytest.skip("jq is not on PATH")
    block = _snippet("sh", "jq")
    entries = ledger(superseded_run)
    outputs = []
    for argv in commands(block):
        assert argv[0] == "jq", argv
        argv = [str(superseded_run / ".loss.json") if a == "RUN_DIR/.loss.json" else a for a in argv]
        redirect = argv.index(">") if ">" in argv else None
        result = subprocess.run(argv[:redirect], capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert result.returncode == 0, result.stderr
        if redirect is not None:
            (tmp_path / argv[redirect + 1]).write_text(result.stdout)
        outputs.append(result.stdout)
    effective, step_tsv, eval_tsv, life = outputs
    rows = [line.split("\t") for line in step_tsv.splitlines()]
    expected = ledger_mod.history(entries)
    assert [int(r[0]) for r in rows] == [e["step"] for e in expected] == list(range(1, FIXTURE_STEPS + 1))
    assert [float(r[1]) for r in rows] == pytest.approx([e["loss"] for e in expected], rel=1e-12)
    evals = [line.split("\t") for line in eval_tsv.splitlines()]
    expected_evals = [(e["step"], e["val_loss"]) for e in plots.live_evals(entries)]  # what `plot` draws
    assert [int(s) for s, _ in evals] == [s for s, _ in expected_evals] == list(range(10, FIXTURE_STEPS + 1, 10))
    assert [float(v) for _, v in evals] == pytest.approx([v for _, v in expected_evals], rel=1e-12)
    assert {"start", "resume"} <= {json.loads(line)["event"] for line in life.splitlines()}


def test_the_pandas_snippet_gives_the_effective_history(superseded_run, tmp_path):
    import pandas as pd  # the test extra's (pyproject.toml): the snippet is shown, so it is run
    block = _snippet("python", "pd.DataFrame")
    script = tmp_path / "snippet.py"  # run as the reader would, a script of its own; its globals come back
    script.write_text(block.text.replace("RUN_DIR/.loss.json", str(superseded_run / ".loss.json")))
    scope = runpy.run_path(str(script))
    expected = ledger_mod.history(ledger(superseded_run))
    assert list(scope["steps"].index) == [e["step"] for e in expected]
    assert list(scope["steps"]["loss"]) == [e["loss"] for e in expected]
    assert len(scope["superseded"]) > 0 and isinstance(scope["steps"], pd.DataFrame)


# --- 3. the README's corpus example and the links -------------------------------------------------------------------

def test_the_readme_corpus_example_is_the_one_prepare_runs():
    [prepare] = [argv for _, argv in sh_commands() if argv[3:4] == ["prepare"]]
    assert prepare[prepare.index("--config") + 1] == "corpus.toml"
    assert PLACEHOLDERS["corpus.toml"] == "corpus_toml"  # Workspace writes readme_corpus_example() there


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_names_a_file_and_heading_that_exist():
    anchors = {}
    for doc in DOCS:
        text = re.sub(r"(?ms)^```.*?^```", "", doc.read_text())
        anchors[doc] = {_slug(h) for h in re.findall(r"(?m)^#+ (.*)$", text)}
    for doc in DOCS:
        text = re.sub(r"(?ms)^```.*?^```", "", doc.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.relative_to(ROOT)}: link to missing {target}"
            if anchor:
                assert anchor in anchors.get(dest, set()), f"{doc.relative_to(ROOT)}: no heading #{anchor} in {path}"
