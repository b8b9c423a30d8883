"""Course-lab mode: graded exercises inside the notebooks, a student build and a local grader.

* :mod:`.registry`: the exercises (:data:`EXERCISES`): task, notebook, points, what the cell defines.
* :mod:`.checking`: ``check(exercise_id, *objects)``, called by a notebook's check cell.
* ``checks_memory``, ``checks_kernels``, ``checks_serving``, ``checks_load``: the check of each
  exercise, comparing the student's objects with the package's own implementation.
* :mod:`.notebook`: exercise cells and solution regions; the student build.
* :mod:`.grader`: grade a student's notebooks, a table or JUnit XML.

``python -m paged_attention lab list|build|grade``; the instructor's guide is
``notebooks/TEACHING.md``.
"""

from .checking import CheckFailed, check
from .registry import EXERCISES, Exercise

__all__ = ["EXERCISES", "CheckFailed", "Exercise", "check"]
