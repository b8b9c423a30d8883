"""No cell can fool the grader: every cheating cell earns nothing, each with a clear status.

Two layers are shown apart. The *sandbox* (a child process per exercise, limits, a read-only
package, the verdict computed here from what the child reports on cases drawn here): the cheats run
unscreened through :class:`ChildStudent` and the check, and change nothing. The *screen* (the cell's
text read before anything runs): the plain ways into the grader or the package's reference are
refused by name, which is what stops a cell from making its own process report the reference's
answers.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from paged_attention._checks import as_dtype
from paged_attention.engine.worker.kv_cache import KVCacheSpec
from paged_attention.lab import EXERCISES
from paged_attention.lab.checking import CheckFailed, checker, run
from paged_attention.lab.checks_memory import DTYPES
from paged_attention.lab.grader import grade_cell, screen
from paged_attention.lab.notebook import exercise_cells, read, strip_solutions
from paged_attention.lab.sandbox import PACKAGE_ROOT, CellError, ChildStudent, LimitExceeded
from paged_attention.lab.student import Student

ROOT = Path(__file__).resolve().parent.parent
QUEUE = EXERCISES["02.free_queue"]


def student_cell(exercise_id: str) -> str:
    """The exercise's cell as the student build hands it out (every method raises)."""
    exercise = EXERCISES[exercise_id]
    cell = next(
        c
        for c in exercise_cells(read(ROOT / "notebooks" / exercise.notebook))
        if c.exercise_id == exercise_id
    )
    return strip_solutions(cell.source, exercise_id, "test")[0]


STUB = student_cell("02.free_queue")


def unscreened(code: str, exercise_id: str = "02.free_queue", seed: int = 3, **limits: float) -> str:
    """Run a cell through the sandbox and the check, skipping the screen; the outcome in a word."""
    exercise = EXERCISES[exercise_id]
    try:
        with ChildStudent(exercise, code, **limits) as student:
            checker(exercise_id)(student, seed=seed, thorough=False)
    except NotImplementedError:
        return "unfinished"
    except CheckFailed as err:
        return f"fail: {err}"
    except LimitExceeded as err:
        return f"{err.kind}: {err}"
    except CellError as err:
        return f"error: {err}"
    return "pass"


PATCH_GRADER = """
import paged_attention.lab.grader as grader
grader.grade_cell = lambda *args, **kwargs: grader.Grade("02.free_queue", "", "pass", 2, 2)
grader.screen = lambda *args: ""
"""
PATCH_CHECKS = """
import paged_attention.lab.checking as checking
import paged_attention.lab.checks_memory as checks
checks.free_queue = lambda *args, **kwargs: 999
checking.expect = lambda *args, **kwargs: None
checking.run = lambda *args, **kwargs: 999
"""
STACK = """
class FreeQueue:  # a stack: hands out the most recently freed block first (wrong)
    def __init__(self, blocks):
        self.items = list(blocks)
        self._relink()
    def _relink(self):
        for block in self.items:
            block.prev_free = block.next_free = None
    def __len__(self):
        return len(self.items)
    def __iter__(self):
        return iter(list(self.items))
    def append(self, block):
        self.items.append(block)
    def remove(self, block):
        self.items.remove(block)
    def popleft(self):
        return self.items.pop()

import paged_attention.memory.allocator as allocator
allocator.FreeBlockQueue = FreeQueue  # the package's reference now agrees with the stack
"""
FAKE_PASS = """
print("✓ 02.free_queue (The O(1) free queue): all 43 cases pass")
print('{"number": 2, "value": {}}')
print("total: 19/19 points, 12 of 12 exercises pass")
"""


@pytest.mark.parametrize(
    "name, code, outcome",
    [
        ("patches the grader", PATCH_GRADER + STUB, "unfinished"),
        ("patches the checks", PATCH_CHECKS + STUB, "unfinished"),
        ("patches the package's reference", STACK, "fail: after FreeQueue"),
        ("prints a fake pass line", FAKE_PASS + STUB, "unfinished"),
        ("exits early with status 0", "raise SystemExit(0)\n" + STUB, "error: the cell called exit(0)"),
        (
            "ends its process with status 0",
            "import os\nos._exit(0)\n" + STUB,
            "error: the process running the cell exited with status 0",
        ),
    ],
)
def test_the_sandbox_ignores_what_the_cell_changes_in_its_process(name: str, code: str, outcome: str) -> None:
    assert unscreened(code).startswith(outcome)


def test_a_cell_that_sleeps_forever_times_out() -> None:
    start = time.monotonic()
    outcome = unscreened("import time\ntime.sleep(10**6)\n" + STUB, time_limit=4)
    assert outcome.startswith("timeout: took longer than 4 s (loading the cell)")
    assert time.monotonic() - start < 20


def test_a_cell_that_allocates_without_bound_hits_the_memory_limit() -> None:
    code = "held = []\nwhile True:\n    held.append(bytearray(1 << 26))\n" + STUB
    assert unscreened(code, memory_limit=256 << 20).startswith(
        "memory: went past the memory limit of 256 MiB"
    )


@pytest.mark.parametrize(
    ("exercise_id", "prefix", "torch"),
    [
        ("02.free_queue", "", False),
        ("02.free_queue", "import torch\n", True),
        ("03.online_softmax", "", True),
    ],
)
def test_a_child_has_torch_only_where_the_exercise_or_the_cell_names_it(
    exercise_id: str, prefix: str, torch: bool
) -> None:
    """A bookkeeping exercise's child starts without torch (~0.2 s instead of ~2); where the setup or
    the cell names it, torch is loaded before the limits, as the exercise's own imports are, so the
    memory limit counts from the same place as before."""
    with ChildStudent(EXERCISES[exercise_id], prefix + student_cell(exercise_id)) as student:
        assert student.process is not None
        maps = Path(f"/proc/{student.process.pid}/maps").read_text()
    assert ("libtorch" in maps) == torch


def test_a_cell_cannot_change_the_package_on_disk() -> None:
    target = PACKAGE_ROOT / "paged_attention" / "lab" / "grader.py"
    before = hashlib.sha256(target.read_bytes()).hexdigest()
    code = f"with open({str(target)!r}, 'a') as f:\n    f.write('# patched by a cell')\n" + STUB
    with ChildStudent(EXERCISES["01.kv_bytes"], "def kv_bytes_per_token(*a):\n    return 0\n") as probe:
        confined = probe.confined
    outcome = unscreened(code)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == before, "the cell changed the grader's file"
    if not confined:
        pytest.skip("this system allows no mount namespace here: the package is writable by the cell")
    assert outcome.startswith("error: the cell raised OSError at line 1: [Errno 30] Read-only file system")


class Recorder(Student):
    """Answers every case with the package's own answer, and remembers them: a table of the
    notebook's cases, as a student could copy it from a run of the check cell."""

    def __init__(self) -> None:
        self.answers: dict[tuple, int] = {}

    def call(self, case: str, name: str, *args: object, hint: str = "") -> object:
        layers, heads, dim, size = args
        dtype = next(d for d in map(as_dtype, DTYPES) if d.itemsize == size)
        self.answers[args] = KVCacheSpec(layers, heads, dim, dtype).bytes_per_token
        return self.answers[args]


def test_hard_coded_answers_to_the_notebooks_cases_fail_on_fresh_ones() -> None:
    seen = Recorder()
    checker("01.kv_bytes")(seen, seed=0, thorough=True)
    code = f"ANSWERS = {seen.answers!r}\n\ndef kv_bytes_per_token(*args):\n    return ANSWERS.get(args, 0)\n"
    assert grade_cell(EXERCISES["01.kv_bytes"], code, seed=0).status == "pass"  # the cases it memorised
    fresh = grade_cell(EXERCISES["01.kv_bytes"], code)
    assert (fresh.status, fresh.earned) == ("fail", 0) and fresh.seed != 0
    assert "got 0" in fresh.detail


def test_every_run_draws_fresh_cases() -> None:
    right = "def kv_bytes_per_token(layers, heads, dim, size):\n    return 2 * layers * heads * dim * size\n"
    seeds = {grade_cell(EXERCISES["01.kv_bytes"], right).seed for _ in range(3)}
    assert len(seeds) == 3


REFERENCE_ALIAS = "from paged_attention.memory.allocator import FreeBlockQueue as FreeQueue\n"
REFERENCE_BY_NAME = """import paged_attention.memory.allocator as allocator
FreeQueue = getattr(allocator, "".join(["FreeBlock", "Queue"]))
"""
REPORTS_THE_REFERENCE = (
    """
import paged_attention.lab.checks_memory as checks
from paged_attention.memory.allocator import KVCacheBlock
"""
    + STUB
)


@pytest.mark.parametrize(
    "code, status, detail",
    [
        (PATCH_GRADER + STUB, "error", "line 2 imports paged_attention.lab.grader, which no exercise needs"),
        (PATCH_CHECKS + STUB, "error", "line 2 imports paged_attention.lab.checking"),
        (REPORTS_THE_REFERENCE, "error", "line 2 imports paged_attention.lab.checks_memory"),
        (REFERENCE_ALIAS, "error", "line 1 imports FreeBlockQueue from paged_attention.memory.allocator"),
        (REFERENCE_BY_NAME + STUB, "error", "line 2 uses getattr, which no exercise needs"),
        ("from paged_attention import lab\n" + STUB, "error", "line 1 imports from paged_attention"),
        ("import _thread\n" + STUB, "error", "line 1 imports _thread, which no exercise needs"),
        ("q = 'FreeBlock' 'Queue'\n" + STUB, "unfinished", "Exercise 02.free_queue: "),  # words are free
        ("x = ().__class__.__base__\n" + STUB, "error", "reads .__base__"),
        (STACK, "error", "uses .FreeBlockQueue of an object it did not make"),
        (FAKE_PASS + STUB, "unfinished", "Exercise 02.free_queue: "),
        ("raise SystemExit(0)\n" + STUB, "error", "the cell called exit(0) while loading"),
        ("import os\nos._exit(0)\n" + STUB, "error", "line 1 imports os"),
        ("import time\nwhile True:\n    time.sleep(1)\n" + STUB, "timeout", "took longer than 3 s"),
        ("x = [0] * (1 << 34)\n" + STUB, "memory", "went past the memory limit"),
        ("f = (lambda: 0).__globals__\n" + STUB, "error", "line 1 reads .__globals__"),
        ("g = eval('1')\n" + STUB, "error", "line 1 uses eval"),
    ],
)
def test_every_cheating_cell_earns_nothing(code: str, status: str, detail: str) -> None:
    grade = grade_cell(QUEUE, code, time_limit=3)
    assert (grade.status, grade.earned) == (status, 0), grade.detail
    assert detail in grade.detail, grade.detail


def test_a_cell_cannot_write_outside_its_own_folder(tmp_path: Path) -> None:
    target = tmp_path / "written-by-a-cell.txt"
    with ChildStudent(EXERCISES["01.kv_bytes"], "def kv_bytes_per_token(*a):\n    return 0\n") as probe:
        confined = probe.confined
    outcome = unscreened(f"open({str(target)!r}, 'w').write('x')\n" + STUB)
    if not confined:
        pytest.skip("this system allows no mount namespace here: the cell can write where its user can")
    assert not target.exists() and "Read-only file system" in outcome


@pytest.mark.parametrize(
    "cell",
    [
        "from paged_attention.engine.core.scheduler import SchedulingPolicy\nPolicy = SchedulingPolicy\n",
        "class Policy(SchedulingPolicy):\n    pass\n",
        "class Policy(SchedulingPolicy):\n    def victim(self, running):\n        return running[-1]\n",
    ],
    ids=["the package's class", "inherits both", "inherits admits"],
)
def test_a_policy_that_inherits_the_packages_rule_earns_nothing(cell: str) -> None:
    grade = grade_cell(EXERCISES["04.scheduling_policy"], cell)
    assert (grade.status, grade.earned) == ("fail", 0) and "inherits" in grade.detail, grade.detail


def test_a_kernel_that_is_not_a_triton_kernel_earns_nothing() -> None:
    cell = "def paged_scores_kernel(*args, **kwargs):\n    return None\n"
    grade = grade_cell(EXERCISES["03.block_table"], cell)
    assert (grade.status, grade.earned) == ("fail", 0) and "not a @triton.jit kernel" in grade.detail


def test_the_policy_cannot_call_the_packages_own_rule() -> None:
    cell = student_cell("04.scheduling_policy")
    lazy = cell.replace(
        'raise NotImplementedError("Exercise 04.scheduling_policy: ',
        "return super().admits(seq, num_new_tokens, cache_manager)  # (",
        1,
    )
    assert "reads .admits of something else than self" in screen(EXERCISES["04.scheduling_policy"], lazy)
    direct = cell.replace(
        'raise NotImplementedError("Exercise 04.scheduling_policy: ',
        "return cache_manager.can_admit(seq, num_new_tokens)  # (",
        1,
    )
    assert "uses .can_admit of an object it did not make" in screen(EXERCISES["04.scheduling_policy"], direct)


# -- right answers are graded by what they do, whatever words they use ------------------------------
def _in_the_notebooks_words(exercise_id: str) -> str:
    """The notebook's own answer, plus a comment, a docstring, a string, parameters, local names and
    attributes of the cell's own object spelled like every name of the package's implementation."""
    exercise = EXERCISES[exercise_id]
    path = Path(__file__).resolve().parent.parent / "notebooks" / exercise.notebook
    answer = next(c.source for c in exercise_cells(read(path)) if c.exercise_id == exercise_id)
    words = exercise.references or ("reference",)  # the kernel exercises have no named implementation
    params = ", ".join(f"{w}=0" for w in words)
    body = "".join(f"    {w}_total = {w} + 1\n    {w} = {w}_total\n" for w in words)
    attributes = "".join(f"        self.{w} = {i}\n" for i, w in enumerate(words))
    read_back = " + ".join(f"_own.{w}" for w in words)
    return (
        f"# uses the notebook's words: {', '.join(words)}\n"
        f"NOTE = 'about {' and '.join(words)}'\n"
        f'def _in_words({params}):\n    """{", ".join(words)}: the same words again."""\n{body}'
        f"    return 0\n\n\nclass _Own:\n    def __init__(self):\n{attributes}\n\n"
        f"_own = _Own()\n_total = {read_back}\n\n{answer}"
    )


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_a_right_answer_in_the_notebooks_own_words_passes_here_and_in_the_notebook(exercise_id: str) -> None:
    exercise = EXERCISES[exercise_id]
    assert not any(word in exercise.setup for word in exercise.references)
    cell = _in_the_notebooks_words(exercise_id)
    assert screen(exercise, cell) == ""
    grade = grade_cell(exercise, cell, seed=5, thorough=False)  # the grader's path; the notebook's cases
    assert (grade.status, grade.earned) == ("pass", exercise.points), grade.detail
    namespace: dict = {}
    exec(compile(exercise.setup + cell, f"<{exercise_id}>", "exec"), namespace)  # as the notebook runs it
    assert run(exercise_id, *(namespace[name] for name in exercise.names), seed=5) > 0
