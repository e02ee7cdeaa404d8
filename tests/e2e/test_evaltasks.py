"""`andrea eval` (andrea/commands/evaluate.py) and its pure core (andrea/evals/tasks.py): reading a HellaSwag-format
file, rows, truncation, padding and the three accuracies; then a tiny run that memorized tests/tasks/memorized.jsonl
scores it well above chance, with every ending's log-likelihood equal to one computed through `transformers` on the
run's export.

The pure tests use hand-built logits, a bigram "model" and a randomly initialised tiny GPT (no run). One tiny run is
trained per module (~10 s) on the tasks' contexts followed by their correct endings; everything else is in-process.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from andrea.config import load as configload
from andrea.evals import tasks as ev
from andrea.evals.audit import TaskAudit
from andrea.cli import main as cli_main
from andrea.commands.evaluate import evaluate_run
from andrea.config.check import ConfigError
from andrea.config.schema import RunConfig
from andrea.rundir import names
from andrea.control.run.trainer import Trainer
from tests.runs import ROOT, seed_data, train

TASKS = ROOT / "tests" / "tasks" / "memorized.jsonl"
STEPS = 300  # at 300 tiny-preset steps the run has memorized every example (acc 1.0); at 100, 0.4; at 150, 0.8
COPIES = 10  # the corpus: the file's examples with their correct endings, 10 times, each time in another order


class ByteCodec:
    """A tokenizer for the pure tests: one token per UTF-8 byte (ids < 256)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def task(context: str, endings: list[str], label: int = 0, line: int = 1) -> ev.Task:
    return ev.Task(line, context, tuple(endings), label)


# --- the file -----------------------------------------------------------------------------------------------------
def test_the_shipped_file_reads_as_42_four_way_examples_with_hellaswags_extra_keys_ignored():
    f = ev.read_tasks(TASKS)
    assert len(f.tasks) == 42 and all(len(t.endings) == 4 for t in f.tasks)
    assert [t.line for t in f.tasks] == list(range(1, 43))
    assert f.tasks[3].label == int(json.loads(TASKS.read_text().splitlines()[3])["label"])  # "label": "1" there
    assert len(f.sha256) == 64


def test_blank_lines_are_skipped_and_a_bad_line_after_them_is_named_by_its_own_number():
    good = json.dumps({"ctx": "a", "endings": ["b", "c"], "label": "1"})
    tasks = ev.parse_tasks(["", good, "   ", good], "f.jsonl")
    assert [(t.line, t.label) for t in tasks] == [(2, 1), (4, 1)]
    with pytest.raises(ev.TaskFileError, match=r"^f\.jsonl:5: not JSON"):
        ev.parse_tasks([good, "", "", good, "{oops"], "f.jsonl")


# --- rows, batches, truncation ----------------------------------------------------------------------------------------
def test_rows_keep_the_rightmost_block_size_tokens_cutting_the_context_on_the_left():
    ctx = list(range(10, 20))  # 10 tokens
    [fits, cut, long] = ev.task_rows(ctx, [[1, 2], [3, 4, 5], list(range(30, 40))], block_size=8)
    assert fits == ev.Row((14, 15, 16, 17, 18, 19, 1, 2), 6)  # 4 context tokens dropped, the ending whole
    assert cut == ev.Row((15, 16, 17, 18, 19, 3, 4, 5), 5)
    # An ending longer than block_size - 1: the row is its last 8 tokens, of which 7 have a predecessor.
    assert long == ev.Row(tuple(range(32, 40)), 1)
    [short] = ev.task_rows([7], [[8, 9]], block_size=8)
    assert short == ev.Row((7, 8, 9), 1)


def test_batches_pack_whole_examples_up_to_batch_size_rows_and_a_big_example_goes_alone():
    assert ev.plan_batches([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert ev.plan_batches([4, 4, 4], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert ev.plan_batches([2, 5, 1, 1], 6) == [range(0, 1), range(1, 3), range(3, 4)]
    assert ev.plan_batches([], 8) == []


def test_padding_marks_only_each_rows_scored_positions():
    idx, scored = ev.pad_rows([ev.Row((5, 6, 7, 8), 2), ev.Row((9, 10), 1)])
    assert idx.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert scored.tolist() == [[False, True, True], [True, False, False]]  # logits[:, t] predict token t + 1


# --- the three scores -------------------------------------------------------------------------------------------
def test_sum_mean_and_per_character_normalisation_on_hand_built_logits():
    # V = 4; logits = log p, so log_softmax gives back log p exactly (each p sums to 1).
    p_first = torch.tensor([0.1, 0.2, 0.3, 0.4])  # what follows the context token
    p_then = torch.tensor([0.25, 0.25, 0.4, 0.1])  # what follows any other token
    logits = torch.stack([torch.stack([p_first.log(), p_then.log(), p_then.log(), p_then.log()])] * 2)  # (2, 4, 4)
    # Ending A: one token (id 1, p 0.2). Ending B: three tokens (ids 2, 2, 2: p 0.3, then 0.4, 0.4).
    idx, scored = ev.pad_rows([ev.Row((0, 1), 1), ev.Row((0, 2, 2, 2), 1)])
    sums, counts = ev.row_logprobs(logits, idx, scored)
    assert counts.tolist() == [1, 3]
    a, b = math.log(0.2), math.log(0.3) + 2 * math.log(0.4)
    assert sums.tolist() == pytest.approx([a, b], abs=1e-6)
    ex = ev.ExampleScore(1, 1, (a, b), (1, 3), (10, 2))  # A is 10 characters long, B 2
    assert ex.pred == 0  # sum: A (-1.61) above B (-3.04)
    assert ex.pred_norm == 1  # per token: B (-1.01) above A (-1.61)
    assert ex.pred_norm_chars == 0  # per character: A (-0.16) above B (-1.52)
    score = ev.TaskScore((ex, ev.ExampleScore(2, 0, (-1.0, -1.0), (1, 1), (1, 1))))  # a tie goes to ending 0
    assert (score.acc, score.acc_norm, score.acc_norm_chars) == (0.5, 1.0, 0.5)


def bigram(vocab: int = 256, seed: int = 0) -> tuple[ev.ModelForward, torch.Tensor]:
    """A "model" whose logits at a position depend on that position's token alone: log P[prev, next]."""
    logp = torch.log_softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 3, dim=1)
    return (lambda idx: logp[idx]), logp  # (B, T) -> (B, T, V)


def test_score_tasks_sums_each_endings_own_bigrams_with_a_leading_space():
    forward, logp = bigram()
    tasks = [task("The cat", ["sat.", "ran away.", "is"], 1), task("A dog", ["barks", "x"], 0, line=3)]
    score = ev.score_tasks(forward, ByteCodec(), tasks, block_size=64, batch_size=4)
    for t, ex in zip(tasks, score.examples):
        ctx = list(t.context.encode())
        for i, e in enumerate(t.endings):
            tokens = ctx + list((" " + e).encode())
            want = sum(logp[tokens[p - 1], tokens[p]].item() for p in range(len(ctx), len(tokens)))
            assert ex.logprob[i] == pytest.approx(want, abs=1e-5)
            assert ex.n_tokens[i] == len(e) + 1 and ex.n_chars[i] == len(e)
    assert [e.line for e in score.examples] == [1, 3] and [e.label for e in score.examples] == [1, 0]


def test_a_context_the_tokenizer_encodes_to_nothing_is_named_by_its_line(tmp_path):
    class DropsSpaces(ByteCodec):
        def encode(self, text: str) -> list[int]:
            return [b for b in text.encode() if b != 32]

    forward, _ = bigram()
    with pytest.raises(ev.TaskFileError, match=r"^t\.jsonl:4: 'ctx' \"  \" encodes to no tokens"):
        ev.score_tasks(forward, DropsSpaces(), [task("a", ["b", "c"]), task("  ", ["b", "c"], line=4)], 64,
                       where="t.jsonl")

    # The audit during training says it when the run starts, not at its first audit (the same line).
    path = tmp_path / "t.jsonl"
    path.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{"ctx": "  ", "endings": ["b", "c"], "label": 0}\n')
    # a configuration error (exit 2: a restart cannot mend the file), naming the key, the file and the line
    named = rf"^eval\.tasks: {re.escape(str(path))}:2: 'ctx' \"  \" encodes to no tokens"
    with pytest.raises(ConfigError, match=named):
        TaskAudit(path, DropsSpaces(), RunConfig())


def random_gpt() -> Trainer:
    """The tiny preset's GPT with weights ~ N(0, 0.3): far-from-uniform logits, so a padding leak would show."""
    trainer = Trainer(configload.load(preset="andrea-tiny"), torch.device("cpu"))
    trainer.state.w.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    return trainer


def varied_tasks(n: int, seed: int = 0) -> list[ev.Task]:
    rng = random.Random(seed)
    words = "the a cat dog ran sat on under big small red very quickly home".split()
    phrase = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [task(phrase(rng.randint(1, 12)), [phrase(rng.randint(1, 6)) for _ in range(rng.randint(2, 5))],
                 line=i + 1) for i in range(n)]


def test_padding_changes_no_score_an_example_alone_equals_it_in_a_padded_batch():
    trainer = random_gpt()
    forward = ev.trainer_forward(trainer)
    tasks = varied_tasks(12)
    codec = ByteCodec()
    batched = ev.score_tasks(forward, codec, tasks, block_size=64, batch_size=64)  # all 12 in one padded forward
    widths = {len(r.tokens) for t in tasks for r in ev.task_rows(*ev.encode_task(t, codec), 64)}
    assert len(widths) > 5  # rows of many lengths: most of the batch is padded
    for t, ex in zip(tasks, batched.examples):
        for i, row in enumerate(ev.task_rows(*ev.encode_task(t, codec), 64)):
            idx, scored = ev.pad_rows([row])  # this row alone: no padding at all
            [alone], _ = ev.row_logprobs(forward(idx), idx, scored)
            # The same math on wider matmuls: float rounding, on sums up to ~230 in size (measured <= 2e-6).
            assert ex.logprob[i] == pytest.approx(alone.item(), abs=1e-4)
    # What fills the padding is never read: other pad tokens give the same scores (to rounding).
    rows = [r for t in tasks[:4] for r in ev.task_rows(*ev.encode_task(t, codec), 64)]
    idx, scored = ev.pad_rows(rows)
    filled = idx.clone()
    filled[idx == 0] = 77  # every padding slot (byte 0 never occurs in the text)
    assert torch.allclose(ev.row_logprobs(forward(idx), idx, scored)[0],
                          ev.row_logprobs(forward(filled), filled, scored)[0], atol=1e-4, rtol=0)


def test_truncation_scores_the_rightmost_window_and_batch_size_changes_nothing():
    trainer = random_gpt()
    forward = ev.trainer_forward(trainer)
    long = [task("one two three four five six seven eight nine ten " * 3, ["eleven twelve", "end"], 1),
            task("short", ["x " * 40, "y"], 0, line=2)]  # an ending longer than the window
    codec = ByteCodec()
    score = ev.score_tasks(forward, codec, long, block_size=32, batch_size=1)
    for t, ex in zip(long, score.examples):
        for i, e in enumerate(t.endings):
            tokens = (codec.encode(t.context) + codec.encode(" " + e))[-32:]
            k = min(len(e) + 1, len(tokens) - 1)  # the scored tokens: the ending's, as far as they have a predecessor
            with torch.no_grad():
                logp = torch.log_softmax(trainer.model(torch.tensor([tokens]))[0][0].double(), dim=-1)
            want = sum(logp[p - 1, tokens[p]].item() for p in range(len(tokens) - k, len(tokens)))
            assert ex.n_tokens[i] == k and ex.logprob[i] == pytest.approx(want, abs=1e-4)
    wide = ev.score_tasks(forward, codec, long, block_size=32, batch_size=8)
    flat = lambda s: [lp for e in s.examples for lp in e.logprob]  # noqa: E731
    assert flat(wide) == pytest.approx(flat(score), abs=1e-4)


def test_scoring_a_live_trainer_between_steps_changes_none_of_its_training_bytes():
    # What a periodic eval at a step boundary must guarantee: weights, moments and gradient untouched, and the next
    # step exactly the step it would have been (train_step sets train mode again).
    cfg = configload.load(preset="andrea-tiny")
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.block_size),
                      generator=torch.Generator().manual_seed(0))
    plain, scored = Trainer(cfg, torch.device("cpu")), Trainer(cfg, torch.device("cpu"))
    for t in (plain, scored):
        t.train_step(0, x, x.roll(-1, dims=1))
    before = scored.state.buffer.clone(), scored.state.grad.clone()
    ev.score_tasks(ev.trainer_forward(scored), ByteCodec(), varied_tasks(6), cfg.model.block_size)
    assert torch.equal(scored.state.buffer, before[0]) and torch.equal(scored.state.grad, before[1])
    for t in (plain, scored):
        t.train_step(1, x, x.roll(-1, dims=1))
    assert torch.equal(plain.state.buffer, scored.state.buffer)


def test_progress_off_a_terminal_is_a_log_line_of_examples_done(monkeypatch, caplog):
    import logging

    from andrea.control.observe.progress import CountProgress
    monkeypatch.setattr(CountProgress, "LOG_SECONDS", 0.0)
    progress = CountProgress(8, "eval", "examples")  # pytest's stderr is no terminal: no bar
    forward, _ = bigram()
    with caplog.at_level(logging.INFO, logger="andrea.control.observe.progress"):
        ev.score_tasks(forward, ByteCodec(), varied_tasks(8), 64, batch_size=12, progress=progress)
    progress.close()
    assert progress.bar is None and progress.done == 8
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval: ")]
    assert lines and lines[-1].startswith("eval: 8 of 8 examples (100 %)"), lines


# --- bad input: one line naming the file (and line), exit 1 ---------------------------------------------------------
GOOD = json.dumps({"ctx": "A man", "endings": ["walks.", "runs."], "label": 0})


def line_of(**fields) -> str:
    return json.dumps({"ctx": "A man", "endings": ["walks.", "runs."], "label": 0, **fields})


BAD_FILES = {  # name: (content, the line it is on or None, the words the error says)
    "not JSON": (f"{GOOD}\n{{'ctx': 1}}\n", 2, "not JSON"),
    "not an object": (f"{GOOD}\n[1, 2]\n", 2, "a JSON list, where an object"),
    "lacks fields": ('{"ctx": "A man", "label": 0}\n', 1, "no 'endings' field"),
    "label out of range": (f"{GOOD}\n{GOOD}\n{line_of(label=2)}\n", 3, "label 2 out of range for 2 endings (0..1)"),
    "label not a number": (line_of(label="one") + "\n", 1, "'label' must be an integer"),
    "label a boolean": (line_of(label=True) + "\n", 1, "'label' must be an integer"),
    "one ending": (line_of(endings=["walks."]) + "\n", 1, "1 ending(s): a multiple-choice example needs at least 2"),
    "endings not strings": (line_of(endings=["walks.", 3]) + "\n", 1, "'endings' must be a list of strings"),
    "an empty ending": (line_of(endings=["walks.", ""]) + "\n", 1, "ending 1 is empty"),
    "an empty context": (line_of(ctx="") + "\n", 1, "'ctx' must be a non-empty string"),
    "empty file": ("", None, "no examples (the file is empty"),
    "blank lines only": ("\n  \n\n", None, "no examples"),
}


@pytest.fixture
def untrained(tmp_path) -> Path:
    """A run directory holding only run.toml (the tiny preset): a run, but no checkpoint and no tokenizer."""
    run = tmp_path / "run"
    run.mkdir()
    (run / names.CONFIG_NAME).write_text(configload.load(preset="andrea-tiny").to_toml())
    return run


def refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert not out and len(lines) == 1 and lines[0].startswith("andrea: error: "), err
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_tasks_file_is_one_line_naming_the_file_and_line(case, untrained, tmp_path, capsys):
    content, line, words = BAD_FILES[case]
    path = tmp_path / "tasks.jsonl"
    path.write_text(content)
    error = refused(["eval", str(untrained), "--tasks", str(path)], capsys)
    assert f"{path}:{line}: " in error if line else f"{path}: " in error, error
    assert words in error, error


@pytest.mark.parametrize("case,words", [("missing", "no such file"), ("directory", "is a directory"),
                                        ("not UTF-8", "3: not UTF-8 text (byte 3 of the line)")])
def test_a_tasks_path_that_is_no_text_file_is_one_line(case, words, untrained, tmp_path, capsys):
    path = tmp_path / "tasks.jsonl"
    if case == "directory":
        path.mkdir()
    elif case == "not UTF-8":  # on line 3: the line is named
        path.write_bytes(b'{"ctx": "a", "endings": ["b", "c"], "label": 0}\n\n{"c\xff')
    error = refused(["eval", str(untrained), "--tasks", str(path)], capsys)
    assert error.startswith(f"andrea: error: {path}") and words in error, error


def test_a_run_without_checkpoints_is_refused_after_the_file_is_read(untrained, capsys):
    error = refused(["eval", str(untrained), "--tasks", str(TASKS)], capsys)
    assert error == f"andrea: error: {untrained}: no step_NNNNNN.bin checkpoint to evaluate"


def test_a_step_without_its_checkpoint_is_refused(untrained, capsys):
    error = refused(["eval", str(untrained), "--tasks", str(TASKS), "--step", "7"], capsys)
    assert error == f"andrea: error: {untrained}: no step_000007.bin (it holds no checkpoints)"


# --- a run that memorized the file ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The tiny preset trained on the tasks' contexts followed by their correct endings, and nothing else."""
    root = tmp_path_factory.mktemp("eval")
    lines = [t.context + " " + t.endings[t.label] for t in ev.read_tasks(TASKS).tasks]
    rng, corpus = random.Random(0), []
    for _ in range(COPIES):
        rng.shuffle(lines)
        corpus += lines
    (root / "corpus.txt").write_text("\n".join(corpus) + "\n")
    result = train(root / "run", "--steps", str(STEPS), "--set", "data.arms=[]",
                   "--set", f"data.sources=[{{name='tasks', path='{root / 'corpus.txt'}'}}]",
                   "--set", f"eval.tasks='{TASKS}'", "--set", "eval.every=100")  # the task audit while training
    assert result.returncode == 0, result.stderr
    return root / "run"


def test_the_task_audit_while_training_scores_what_eval_scores_on_that_steps_checkpoint(run, tmp_path):
    from andrea.commands.operate import run_status
    from andrea.rundir.ledger import read_ledger
    audits = [e for e in read_ledger(run / names.LEDGER_NAME).entries if e.get("event") == "tasks"]
    assert [e["step"] for e in audits] == list(range(100, STEPS + 1, 100))
    for e in audits:  # the live model at step S is step_S.bin's weights: the same scores to the bit
        offline = evaluate_run(run, TASKS, e["step"], show_progress=False).score
        assert (e["acc"], e["acc_norm"], e["acc_norm_chars"]) == (offline.acc, offline.acc_norm,
                                                                   offline.acc_norm_chars)
        assert (e["examples"], e["tasks"], e["sha256"]) == (42, TASKS.name, ev.read_tasks(TASKS).sha256)
    assert audits[-1]["acc"] >= 0.8
    status = run_status(run)["tasks"]
    assert status["step"] == STEPS and status["acc"] == audits[-1]["acc"]
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0  # accuracy on its own axis


@pytest.mark.parametrize("case", ["bad", "deleted"])
def test_a_bad_or_missing_tasks_file_refuses_the_start_as_a_configuration_error(case, prepared, tmp_path):
    """Exit 2, as a bad configuration: the docs' systemd unit (RestartPreventExitStatus=2) does not restart a
    run whose eval.tasks file is gone or broken in a loop."""
    bad = tmp_path / "bad.jsonl"
    if case == "bad":
        bad.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    result = train(seed_data(prepared, tmp_path / "run"), "--steps", "5", "--set", f"eval.tasks='{bad}'")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"andrea: error: eval.tasks: {bad}"), result.stderr
    assert (":1: " in errors[0]) if case == "bad" else ("no such file" in errors[0]), errors
    assert not list((tmp_path / "run").glob("step_*.bin"))


def test_a_run_that_memorized_the_file_scores_far_above_chance_and_eval_prints_it(run, capsys):
    capsys.readouterr()
    assert cli_main(["eval", str(run), "--tasks", str(TASKS)]) == 0
    line = capsys.readouterr().out.strip()
    fields = line.split()
    assert line.startswith(f"step {STEPS}  examples 42  acc ") and line.endswith(f"(tasks {TASKS})"), line
    acc, acc_norm = float(fields[fields.index("acc") + 1]), float(fields[fields.index("acc_norm") + 1])
    assert acc >= 0.8 and acc_norm >= 0.8, line  # chance is 0.25; measured 1.0 and 1.0
    assert cli_main(["eval", str(run), "--tasks", str(TASKS), "--json", "--batch-size", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == STEPS and report["checkpoint"] == names.checkpoint_name(STEPS)
    assert (report["examples"], report["acc"], report["acc_norm"]) == (42, acc, acc_norm)  # batch size changes none
    assert report["sha256"] == ev.read_tasks(TASKS).sha256 and report["device"] == "cpu"
    assert 0.0 <= report["acc_norm_chars"] <= 1.0


def test_step_picks_that_checkpoint_and_the_default_skips_an_invalid_newest(run, tmp_path, capsys):
    early = evaluate_run(run, TASKS, 100, show_progress=False)
    assert early.step == 100 and early.checkpoint.name == names.checkpoint_name(100)
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("train.lock", "train.pid"))
    with open(copy / names.checkpoint_name(STEPS), "r+b") as f:
        f.truncate(1000)
    fallback = evaluate_run(copy, TASKS, show_progress=False)
    assert fallback.step == STEPS - 100  # the newest checkpoint that verifies, as export and sample choose it


def test_every_score_equals_transformers_on_the_export(run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra")
    ours = evaluate_run(run, TASKS, show_progress=False).score
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), "--out", str(out)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    T = hf.config.n_positions
    theirs = []
    for t, ex in zip(ev.read_tasks(TASKS).tasks, ours.examples):
        ctx, sums = tok(t.context)["input_ids"], []
        for i, ending in enumerate(t.endings):
            ids = ctx + tok(" " + ending)["input_ids"]
            window = ids[-T:]  # the rightmost n_positions tokens; every ending token with a predecessor is scored
            k = min(len(ids) - len(ctx), len(window) - 1)
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([window])).logits[0].double(), dim=-1)  # one row, no padding
            sums.append(sum(logp[p - 1, window[p]].item() for p in range(len(window) - k, len(window))))
            assert ex.n_tokens[i] == k
        theirs.append(ev.ExampleScore(t.line, t.label, tuple(sums), ex.n_tokens, ex.n_chars))
        # fp32 both sides, the same operations up to summation order: logits agree to ~1e-5 (tests/e2e/test_export.py
        # bounds them by 1e-4), a log-softmax at most doubles that, and an ending has <= 20 tokens here: 1e-4 on a
        # sum is ~30x the measured 3e-6. A wrong token, position, shift or padding leak moves a sum by > 1e-2.
        assert max(abs(a - b) for a, b in zip(ex.logprob, sums)) <= 1e-4, (t.line, ex.logprob, sums)
    theirs = ev.TaskScore(tuple(theirs))
    assert [e.pred for e in theirs.examples] == [e.pred for e in ours.examples]
    assert (theirs.acc, theirs.acc_norm, theirs.acc_norm_chars) == (ours.acc, ours.acc_norm, ours.acc_norm_chars)
    assert any(len(tok(t.context)["input_ids"]) + 8 > T for t in ev.read_tasks(TASKS).tasks)  # truncation was met
