"""The course lab: the checks tell right from wrong, the student build strips answers (and refuses
notebooks it cannot strip safely), the grader grades cell text on its own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from paged_attention.lab import EXERCISES
from paged_attention.lab.checking import CheckFailed, run
from paged_attention.lab.grader import grade_cell, junit_xml, table
from paged_attention.lab.notebook import LabError, student_notebook
from paged_attention.lab.registry import UNPLACED_CHECKS
from paged_attention.memory.allocator import KVCacheBlock
from tests.lab_answers import kernels, load, memory, quantization, serving, spec, structured

ROOT_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# For every exercise: answers written apart from the notebooks, one right (written differently from
# the notebook's solution) and plausible wrong ones a student might write.
ANSWERS = {
    "01.kv_bytes": (memory.kv_bytes_right, [memory.kv_bytes_wrong]),
    "02.free_queue": (
        memory.FreeQueueRight,
        [memory.FreeQueueList, memory.FreeQueueStack, memory.FreeQueueKeepsLinks, memory.FreeQueueScans],
    ),
    "02.slot_mapping": (
        memory.slot_mapping_right,
        [memory.slot_mapping_off_by_one, memory.slot_mapping_logical],
    ),
    "02.copy_on_write": (
        memory.copy_on_write_right,
        [memory.copy_on_write_keeps_reference, memory.copy_on_write_full_blocks_too],
    ),
    "03.online_softmax": (kernels.online_right, [kernels.online_no_rescale, kernels.online_no_max]),
    "03.block_table": (kernels.scores_right, [kernels.scores_logical, kernels.scores_unmasked]),
    "03.split_k_merge": (kernels.merge_right, [kernels.merge_ignores_max, kernels.merge_exp_max]),
    "04.scheduling_policy": (
        serving.PolicyRight,
        [
            serving.PolicyOldestVictim,
            serving.PolicyNoWatermark,
            serving.PolicyFloor,
            serving.PolicyIgnoresComputed,
            serving.PolicyCountsHeldHit,
            serving.PolicyStrict,
            serving.PolicyFirstRunning,
        ],
    ),
    "06.first_fit": (serving.FirstFitRight, [serving.FirstFitNoMerge]),
    "08.block_hashes": (memory.block_hashes_right, [memory.block_hashes_unchained]),
    "09.stream_metrics": (
        load.stream_metrics_right,
        [
            load.stream_metrics_divides_by_chunks,
            load.stream_metrics_all_tokens,
            load.stream_metrics_itl_from_send,
            load.stream_metrics_e2el_from_first,
            load.stream_metrics_forgets_send,
            load.stream_metrics_float32,
        ],
    ),
    "09.arrivals": (
        load.arrival_times_right,
        [
            load.arrival_times_scale_is_mean,
            load.arrival_times_exponential,
            load.arrival_times_gaps,
            load.arrival_times_no_inf,
            load.arrival_times_unseeded,
            load.arrival_times_two_values,
        ],
    ),
    "10.ngram": (
        spec.propose_drafts_right,
        [
            spec.propose_drafts_last_occurrence,
            spec.propose_drafts_shortest_first,
            spec.propose_drafts_without_overlap,
        ],
    ),
    "10.verify": (
        spec.accept_drafts_right,
        [
            spec.accept_drafts_resample_full,
            spec.accept_drafts_no_bonus,
            spec.accept_drafts_bonus_argmax,
            spec.accept_drafts_too_often,
        ],
    ),
    "11.quantize_block": (
        quantization.quantize_block_right,
        [
            quantization.quantize_block_per_block,
            quantization.quantize_block_round_even,
            quantization.quantize_block_truncate,
            quantization.quantize_block_divide_by_128,
            quantization.quantize_block_nan_for_zeros,
        ],
    ),
    "12.token_mask": (
        structured.token_mask_right,
        [
            structured.token_mask_prefix_match,
            structured.token_mask_no_stop,
            structured.token_mask_stop_always,
            structured.token_mask_empty_allowed,
        ],
    ),
}


def test_every_exercise_has_answers_here() -> None:
    assert set(ANSWERS) == set(EXERCISES) and not UNPLACED_CHECKS


def grade(exercise_id: str, answer: object, thorough: bool = False) -> int:
    return run(exercise_id, answer, thorough=thorough)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("exercise_id", sorted(ANSWERS))
def test_a_right_answer_passes(exercise_id: str, seed: int) -> None:
    """On the grader's cases (thorough) from several seeds: the grader draws a fresh one each run."""
    right, _ = ANSWERS[exercise_id]
    assert run(exercise_id, right, thorough=True, seed=seed) > 0


@pytest.mark.parametrize(
    "exercise_id, wrong",
    [(e, w) for e, (_, wrongs) in sorted(ANSWERS.items()) for w in wrongs],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_a_wrong_answer_fails(exercise_id: str, wrong: object) -> None:
    with pytest.raises(CheckFailed):
        grade(exercise_id, wrong)


def test_the_packages_own_load_code_passes_the_load_checks() -> None:
    """Notebook 09 does not exist yet: its checks are shown to agree with the package's reference
    code here (which returns a StreamMetrics, not a tuple, and sends the first request after a gap)."""
    from paged_attention.experiments.latency_stats import stream_metrics
    from paged_attention.experiments.loadgen import arrival_times

    assert grade("09.stream_metrics", stream_metrics, thorough=True) > 0
    assert grade("09.arrivals", arrival_times, thorough=True) > 0


@pytest.mark.parametrize(
    "exercise_id, wrong, hint",
    [
        ("09.stream_metrics", load.stream_metrics_divides_by_chunks, "not by the number of gaps"),
        ("09.stream_metrics", load.stream_metrics_all_tokens, "divide by num_tokens - 1"),
        ("09.stream_metrics", load.stream_metrics_itl_from_send, "is TTFT, not an ITL"),
        ("09.stream_metrics", load.stream_metrics_e2el_from_first, "not from the first chunk"),
        ("09.stream_metrics", load.stream_metrics_forgets_send, "subtract send_time"),
        ("09.stream_metrics", load.stream_metrics_float32, "keep timestamps in float64"),
        ("09.arrivals", load.arrival_times_scale_is_mean, "theta = 1 / (rate * burstiness)"),
        ("09.arrivals", load.arrival_times_exponential, "exponential gaps (CV 1) are burstiness = 1 only"),
        ("09.arrivals", load.arrival_times_gaps, "not the gaps themselves"),
        ("09.arrivals", load.arrival_times_no_inf, "raised ValueError"),
        ("09.arrivals", load.arrival_times_unseeded, "random.Random(seed)"),
        ("09.arrivals", load.arrival_times_two_values, "Kolmogorov-Smirnov"),
        ("10.ngram", spec.propose_drafts_last_occurrence, "the first (earliest) occurrence"),
        ("10.ngram", spec.propose_drafts_shortest_first, "try the longest n first"),
        ("10.ngram", spec.propose_drafts_without_overlap, "may overlap the last n tokens"),
        ("10.verify", spec.accept_drafts_resample_full, "draw from p WITHOUT the draft"),
        ("10.verify", spec.accept_drafts_no_bonus, "then append the argmax"),
        ("11.quantize_block", quantization.quantize_block_per_block, "one scale per KV head, not one for"),
        ("11.quantize_block", quantization.quantize_block_round_even, "halves round up here"),
        ("11.quantize_block", quantization.quantize_block_truncate, "don't truncate"),
        ("11.quantize_block", quantization.quantize_block_divide_by_128, "the scale is max|x| / 127"),
        ("11.quantize_block", quantization.quantize_block_nan_for_zeros, "a head of zeros has scale 0"),
        ("12.token_mask", structured.token_mask_prefix_match, "re.match asks whether the pattern matches"),
        ("12.token_mask", structured.token_mask_no_stop, "the stop tokens may come next exactly when"),
        ("12.token_mask", structured.token_mask_stop_always, "a stop token only after a whole match"),
        ("12.token_mask", structured.token_mask_empty_allowed, "a token without text"),
        ("02.free_queue", memory.FreeQueueKeepsLinks, "a block out of the queue has no links"),
        ("02.free_queue", memory.FreeQueueList, "a block in the queue links to its neighbours"),
        ("02.free_queue", memory.FreeQueueScans, "never scan the queue"),
        ("02.copy_on_write", memory.copy_on_write_keeps_reference, "drop its reference to the shared block"),
        ("02.copy_on_write", memory.copy_on_write_full_blocks_too, "only a partly filled last block"),
        ("03.online_softmax", kernels.online_no_max, "l is the sum of exp(score - m)"),
        ("03.split_k_merge", kernels.merge_exp_max, "maxes near 800: exp(max) overflows float64"),
        ("04.scheduling_policy", serving.PolicyStrict, "exactly the watermark: admit (>=, not >)"),
        ("04.scheduling_policy", serving.PolicyNoWatermark, "below the watermark of 1"),
        ("04.scheduling_policy", serving.PolicyFloor, "round up"),
        ("04.scheduling_policy", serving.PolicyCountsHeldHit, "they exist already and cost no free block"),
        ("04.scheduling_policy", serving.PolicyIgnoresComputed, "num_free_prefix_blocks(seq)"),
        ("04.scheduling_policy", serving.PolicyOldestVictim, "the latest arrival, running[-1]"),
        ("04.scheduling_policy", serving.PolicyFirstRunning, "victim: three running"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_each_mistake_gets_its_own_hint(exercise_id: str, wrong: object, hint: str) -> None:
    with pytest.raises(CheckFailed, match=re.escape(hint)):
        grade(exercise_id, wrong)


def test_a_crash_in_the_students_code_is_a_failing_case_naming_the_call() -> None:
    def crashes(send_time, chunk_times, num_tokens):
        return 1 / 0

    def unfinished(send_time, chunk_times, num_tokens):
        raise NotImplementedError("Exercise 09.stream_metrics: later")

    with pytest.raises(CheckFailed, match=r"stream_metrics\(0\.0, \[0\.2, .*\) raised ZeroDivisionError"):
        grade("09.stream_metrics", crashes)
    with pytest.raises(NotImplementedError, match="later"):
        grade("09.stream_metrics", unfinished)


def test_check_names_the_objects_it_takes() -> None:
    with pytest.raises(TypeError, match="takes 1 object"):
        run("01.kv_bytes")
    with pytest.raises(ValueError, match="exercise_id must be one of"):
        run("99.nothing", memory.kv_bytes_right)


def cell(source: str, tags: list[str] | None = None, kind: str = "code") -> dict:
    out = {"cell_type": kind, "metadata": {"tags": tags or []}, "source": source}
    if kind == "code":
        out.update(outputs=[{"output_type": "stream", "name": "stdout", "text": "secret"}], execution_count=3)
    return out


SOLVED = """def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value):
    \"\"\"Bytes of one token's K and V in every layer.\"\"\"
    ### BEGIN SOLUTION
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value
    ### END SOLUTION
"""


def notebook(*cells: dict) -> dict:
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_the_student_build_strips_the_answer_and_keeps_the_rest() -> None:
    nb = notebook(cell(SOLVED, ["lab:01.kv_bytes"]), cell('check("01.kv_bytes", kv_bytes_per_token)'))
    student = student_notebook(nb, "x.ipynb")
    text = student["cells"][0]["source"]
    assert "return 2 *" not in text and "### BEGIN" not in text
    assert '    raise NotImplementedError("Exercise 01.kv_bytes: ' in text
    assert text.startswith("def kv_bytes_per_token(") and '"""Bytes of one token' in text
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in student["cells"])
    assert all("raises-exception" in c["metadata"]["tags"] for c in student["cells"])
    assert nb["cells"][0]["source"] == SOLVED  # the instructor's notebook is untouched
    assert grade_cell(EXERCISES["01.kv_bytes"], text).status == "unfinished"
    assert grade_cell(EXERCISES["01.kv_bytes"], SOLVED).status == "pass"


@pytest.mark.parametrize(
    "cells, message",
    [
        ([cell(SOLVED.replace("    ### END SOLUTION\n", ""), ["lab:01.kv_bytes"])], "never ended"),
        (
            [
                cell(
                    SOLVED.replace("### BEGIN SOLUTION\n", "### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n"),
                    ["lab:01.kv_bytes"],
                )
            ],
            "nested",
        ),
        ([cell("x = 1\n### END SOLUTION\n", ["lab:01.kv_bytes"])], "without"),
        ([cell(SOLVED)], "without a 'lab:<id>' tag"),
        ([cell("x = 1\n", ["lab:01.kv_bytes"])], "has no"),
        ([cell(SOLVED, ["lab:99.nothing"])], "unknown exercise"),
        (
            [
                cell(SOLVED, ["lab:01.kv_bytes"]),
                cell(
                    "# hint: return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value",
                    kind="markdown",
                ),
            ],
            "would survive",
        ),
    ],
)
def test_the_student_build_refuses_what_it_cannot_strip_safely(cells: list[dict], message: str) -> None:
    with pytest.raises(LabError, match=message):
        student_notebook(notebook(*cells), "x.ipynb")


def test_the_grader_reports_errors_and_missing_names() -> None:
    exercise = EXERCISES["01.kv_bytes"]
    assert grade_cell(exercise, "def other(): pass\n").detail == "the cell defines no kv_bytes_per_token"
    broken = grade_cell(exercise, "def kv_bytes_per_token(a, b, c, d):\n    return a / 0\n")
    assert broken.status == "fail"
    assert broken.detail == (
        "kv_bytes_per_token(40, 40, 128, 2) (OPT-13B in fp16) raised ZeroDivisionError: division by zero "
        "(line 2 of your cell)"
    )
    wrong = grade_cell(exercise, "def kv_bytes_per_token(a, b, c, d):\n    return a * b * c * d\n")
    assert wrong.status == "fail" and "expected 819200, got 409600" in wrong.detail
    typo = grade_cell(exercise, "x = 1\ndef kv_bytes_per_token(a, b, c, d)\n    return 0\n")
    assert typo.status == "error" and typo.detail.startswith("the cell raised SyntaxError at line 2")


CRASHING_QUEUE = """class FreeQueue:
    def __init__(self, blocks):
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def __len__(self):
        return self.size

    def __iter__(self):
        node = self.head.next_free
        while node is not self.tail:
            yield node
            node = node.next_free

    def append(self, block):
        last = self.tail.prev_free
        block.prev_free, block.next_free = last, self.tail
        last.next_free = block
        self.tail.prev_free = block
        self.size += 1

    def remove(self, block):
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.size -= 1

    def popleft(self):
        front = self.head.next_free  # on an empty queue: the tail sentinel, whose next_free is None
        self.remove(front)
        return front
"""


def test_a_crash_names_the_case_and_the_students_own_line() -> None:
    """popleft on an empty queue that unlinks the tail sentinel: the case, the exception and the
    line of the cell that raised (not of the grader's setup, which comes before it, nor of the
    check's module), from the grader and from a notebook's check cell alike."""
    line = CRASHING_QUEUE.splitlines().index("        block.next_free.prev_free = block.prev_free") + 1
    expected = rf"popleft\(\) on the now empty queue raised AttributeError: .* \(line {line} of your cell\)$"
    grade = grade_cell(EXERCISES["02.free_queue"], CRASHING_QUEUE, seed=1)
    assert grade.status == "fail" and re.search(expected, grade.detail), grade.detail
    local: dict = {"KVCacheBlock": KVCacheBlock}
    exec(compile(CRASHING_QUEUE, "<a notebook cell>", "exec"), local)  # as a notebook's check cell sees it
    with pytest.raises(CheckFailed, match=expected):
        run("02.free_queue", local["FreeQueue"])


def test_the_grader_runs_a_triton_kernel_from_cell_text() -> None:
    import inspect

    function = getattr(kernels.scores_right, "fn", kernels.scores_right)  # the interpreter wraps it
    source = inspect.getsource(function).replace("def scores_right", "def paged_scores_kernel")
    code = "import triton\nimport triton.language as tl\n\n" + source
    assert grade_cell(EXERCISES["03.block_table"], code).status == "pass"


def test_the_report_and_junit_xml() -> None:
    grades = [
        grade_cell(EXERCISES["01.kv_bytes"], SOLVED, "01.ipynb"),
        grade_cell(
            EXERCISES["01.kv_bytes"], "raise NotImplementedError('Exercise 01.kv_bytes: later')\n", "01.ipynb"
        ),
    ]
    text = table(grades)
    assert "total: 1/2 points, 1 of 2 exercises pass" in text and "unfinished" in text
    xml = junit_xml(grades)
    assert 'tests="2"' in xml and 'failures="1"' in xml and "unfinished: Exercise 01.kv_bytes: later" in xml


def test_the_lab_command(tmp_path, capsys) -> None:
    from paged_attention.cli.main import main

    source = tmp_path / "mine.ipynb"
    source.write_text(json.dumps(notebook(cell(SOLVED, ["lab:01.kv_bytes"]))))
    results = tmp_path / "results.json"
    assert (
        main(["lab", "grade", str(source), "--junit", str(tmp_path / "r.xml"), "--gradescope", str(results)])
        == 0
    )
    assert "1/1 points" in capsys.readouterr().out and (tmp_path / "r.xml").is_file()
    gradescope = json.loads(results.read_text())
    assert gradescope["score"] == 1 and gradescope["tests"][0]["max_score"] == 1
    assert gradescope["tests"][0]["status"] == "passed" and gradescope["tests"][0]["name"].startswith(
        "01.kv_bytes"
    )
    assert main(["lab", "build", "--out", str(tmp_path / "student"), str(source)]) == 0
    assert main(["lab", "grade", str(tmp_path / "student" / "mine.ipynb")]) == 1
    assert "unfinished" in capsys.readouterr().out


def test_an_unfinished_triton_kernel_is_unfinished_not_an_error() -> None:
    code = (
        "import triton\nimport triton.language as tl\n\n@triton.jit\n"
        "def paged_scores_kernel(q_ptr, k_ptr, t_ptr, o_ptr, seq_len,\n"
        "                        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):\n"
        '    raise NotImplementedError("Exercise 03.block_table: later")\n'
    )
    grade = grade_cell(EXERCISES["03.block_table"], code)
    assert (grade.status, grade.detail) == ("unfinished", "Exercise 03.block_table: later")


def test_lab_grade_without_notebooks_grades_the_student_build_or_refuses(
    tmp_path, monkeypatch, capsys
) -> None:
    from paged_attention.cli import lab as lab_command
    from paged_attention.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lab_command, "ROOT", tmp_path)  # no build/student in the repository either
    with pytest.raises(SystemExit, match=r"no student build in build/student/.*make student"):
        main(["lab", "grade"])
    build = tmp_path / "build" / "student"
    build.mkdir(parents=True)
    (build / "mine.ipynb").write_text(json.dumps(notebook(cell(SOLVED, ["lab:01.kv_bytes"]))))
    assert main(["lab", "grade", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert "1/1 points" in out and "seed 4" in out and "INSTRUCTOR" not in out


def test_grading_the_instructor_notebooks_says_so_loudly(capsys) -> None:
    from paged_attention.cli.main import main

    path = next(p for p in (ROOT_NOTEBOOKS).glob("01_*.ipynb"))
    assert main(["lab", "grade", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("These are the INSTRUCTOR notebooks (01_kv_cache.ipynb)") == 2
