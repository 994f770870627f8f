"""The course's lessons in one table: adding a lesson adds a row here, its notebook and its module.

Everything that lists the lessons reads this table: the Makefile (``make load-test`` runs the
lessons that check speed claims), ``helpers.course.fullscale`` (what each lesson needs on a
card), ``gpu_check`` (the order of the full-scale pass), ``cheatsheet`` (the link to a lesson),
and the tests that hold README's lesson table, ``compat``'s package rows and the preflight's
checks to it (tests/test_syllabus.py).

    python -m helpers.syllabus            # number, notebook, module, title
    python -m helpers.syllabus --timed    # the notebooks that check speed claims, one per line

Example::

    >>> from helpers.syllabus import lesson_entry
    >>> lesson_entry("10").notebook
    '10_sdpa_flash_attention.ipynb'
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class LessonEntry:
    """One lesson: its number, its name (the notebook's stem after the number), its title."""

    number: str  # "05": the notebook's prefix and the results store's tag
    name: str  # "mixed_precision": notebooks/05_mixed_precision.ipynb
    title: str  # README's link text for the lesson
    gpu_rank: int  # the full-scale GPU pass runs lower ranks first (its value per minute)
    timed: bool = True  # the notebook checks speed claims (make load-test runs it under load)
    module: bool = True  # measured through helpers.lessons.<name> (lesson 00 uses the core only)
    preload: tuple[str, ...] = ()  # modules the fork server imports for it too (lesson())

    @property
    def notebook(self) -> str:
        """The notebook's file name in notebooks/."""
        return f"{self.number}_{self.name}.ipynb"

    @property
    def module_name(self) -> str | None:
        """``helpers.lessons.<name>``, or None for a lesson with no module of its own."""
        return f"helpers.lessons.{self.name}" if self.module else None


# Ranks: the capstone, then the memory lessons whose numbers the estimator predicts, then
# speed; lessons an earlier GPU report already covered move towards the end.
LESSONS: tuple[LessonEntry, ...] = (
    LessonEntry("00", "setup_and_measuring", "setup and measuring", 1, module=False),
    LessonEntry("01", "anatomy_of_memory", "anatomy of memory", 2),
    LessonEntry("02", "batch_size", "batch size", 4),
    LessonEntry("03", "gradient_accumulation", "gradient accumulation", 5),
    LessonEntry("04", "gradient_checkpointing", "gradient checkpointing", 6),
    LessonEntry("05", "mixed_precision", "mixed precision", 3),
    LessonEntry("06", "optimizers", "optimizers", 7),
    LessonEntry("07", "accelerate_loop", "Accelerate loop", 12, timed=False),
    LessonEntry("08", "deepspeed_zero", "DeepSpeed ZeRO", 16),
    LessonEntry("09", "mixture_of_experts", "mixture of experts", 13),
    LessonEntry("10", "sdpa_flash_attention", "SDPA and flash attention", 11),
    LessonEntry("11", "data_loading", "data loading", 15),
    LessonEntry(
        "12", "torch_compile", "torch.compile", 14, preload=("torch._inductor.compile_fx",)
    ),
    LessonEntry("13", "peft_lora", "PEFT / LoRA", 10, preload=("peft",)),
    LessonEntry("14", "putting_it_together", "putting it together", 0, preload=("bitsandbytes",)),
    LessonEntry("15", "seeing_memory", "seeing memory", 8, timed=False),
    LessonEntry(
        "16", "more_memory", "more memory from one GPU", 9, preload=("helpers.lessons.more_memory",)
    ),
    LessonEntry(
        "17",
        "beyond_one_gpu",
        "beyond one GPU",
        17,
        timed=False,
        preload=("helpers.lessons.beyond_one_gpu",),
    ),
)
NUMBERS: tuple[str, ...] = tuple(e.number for e in LESSONS)


def lesson_entry(number: str) -> LessonEntry:
    """The row for lesson ``number`` ("05"); a ValueError naming the lessons there are."""
    for entry in LESSONS:
        if entry.number == number:
            return entry
    raise ValueError(f"no lesson {number!r}: the lessons are {', '.join(NUMBERS)}")


def preload_for(number: str) -> tuple[str, ...]:
    """What the fork server preloads for lesson ``number`` besides the usual; () for a number
    with no row (a scratch notebook)."""
    return lesson_entry(number).preload if number in NUMBERS else ()


def by_gpu_rank() -> tuple[str, ...]:
    """Lesson numbers in the order the full-scale GPU pass runs them."""
    return tuple(e.number for e in sorted(LESSONS, key=lambda e: e.gpu_rank))


def main(argv: list[str]) -> int:
    if argv == ["--timed"]:
        print("\n".join(f"notebooks/{e.notebook}" for e in LESSONS if e.timed))
        return 0
    if argv:
        print("usage: python -m helpers.syllabus [--timed]", file=sys.stderr)
        return 2
    for e in LESSONS:
        print(f"{e.number}  {e.notebook:34} {e.module_name or '-':36} {e.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
