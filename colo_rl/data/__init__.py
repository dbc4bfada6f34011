"""Tasks and datasets: the embedded arithmetic task, GSM8K-format and user files."""

from colo_rl.data.arithmetic import ArithmeticTask, make_arithmetic_splits
from colo_rl.data.files import DataError, read_records
from colo_rl.data.prompts import Problem, PromptBuilder, file_problems, load_problems

__all__ = [
    "ArithmeticTask",
    "DataError",
    "Problem",
    "file_problems",
    "PromptBuilder",
    "load_problems",
    "make_arithmetic_splits",
    "read_records",
]
