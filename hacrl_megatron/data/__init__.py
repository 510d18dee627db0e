"""data stage: verifiable prompts for training and evaluation.

- :class:`PromptRecord` (id, question, answer, source, kind): the record every stage passes on;
- :func:`make_task` (name, difficulty, seed): procedural tasks (addition, addition_cot, arithmetic, linear,
  countdown) or a local dataset, with ``sample`` / ``eval_set`` / ``sft_target``;
- :func:`load_benchmark` (name, path, limit): MATH, MATH-500, GSM8K, AIME2025, AMC23, Minerva,
  OlympiadBench from local files;
- :func:`format_prompt` (question, tokenizer, template): per-agent prompt text.
"""

from hacrl_megatron.data.benchmarks import BENCHMARKS, DATA_DIR_ENV, DataFileError, load_benchmark
from hacrl_megatron.data.procedural import TASKS
from hacrl_megatron.data.prompts import CHAT_INSTRUCTION, PLAIN_TEMPLATE, format_prompt
from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.data.tasks import DatasetTask, Task, make_task

__all__ = [
    "BENCHMARKS",
    "CHAT_INSTRUCTION",
    "DATA_DIR_ENV",
    "DataFileError",
    "DatasetTask",
    "PLAIN_TEMPLATE",
    "PromptRecord",
    "TASKS",
    "Task",
    "format_prompt",
    "load_benchmark",
    "make_task",
]
