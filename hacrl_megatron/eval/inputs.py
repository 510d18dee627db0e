"""``hacrl eval``'s input checks, before any model loads: the arguments' ranges, and each agent
folder (an HF model folder with a readable ``config.json``, readable safetensors and, unless
``--tokenizer`` replaces it, a tokenizer). Every failure is one :class:`EvalInputError` naming the
flag or the file and what is wrong (the CLI exits 2), like ``hacrl convert``'s checks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hacrl_megatron.errors import InputError, one_line_text

DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one makes a tokenizer
JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "model.safetensors.index.json")


class EvalInputError(InputError):
    """An ``hacrl eval`` argument or agent folder that cannot be used; names the flag or the file."""


def _require(ok: bool, flag: str, value: Any, rule: str) -> None:
    if not ok:
        raise EvalInputError(f"{flag}={value!r}: {rule}")


def check_eval_args(args: Any) -> None:
    """The numeric flags' ranges and the choices (``args``: the parsed ``hacrl eval`` namespace)."""
    _require(args.k >= 1, "--k", args.k, "must be >= 1 (k of pass@k and best@k)")
    _require(args.n is None or args.n >= args.k, "--n", args.n, f"must be >= --k={args.k} (samples per problem)")
    _require(args.limit is None or args.limit >= 1, "--limit", args.limit, "must be >= 1 (problems per benchmark)")
    _require(1 <= args.max_new_tokens <= 1 << 20, "--max-new-tokens", args.max_new_tokens, "must lie in [1, 1048576]")
    _require(math.isfinite(args.temperature) and args.temperature > 0, "--temperature", args.temperature,
             "must be a finite number > 0")
    _require(0 <= args.verifier_workers <= 256, "--verifier-workers", args.verifier_workers, "must lie in [0, 256]")
    _require(math.isfinite(args.verifier_timeout_s) and 0 < args.verifier_timeout_s <= 3600, "--verifier-timeout-s",
             args.verifier_timeout_s, "must lie in (0, 3600] seconds")
    _require(args.dtype in DTYPES, "--dtype", args.dtype, f"must be one of {list(DTYPES)}")
    _require(args.verifier_mode in ("math", "math_verify"), "--verifier-mode", args.verifier_mode,
             "must be math or math_verify")
    _require(args.difficulty >= 1, "--difficulty", args.difficulty, "must be >= 1")
    low, high = getattr(args, "reward_range", (0.0, 1.0))
    _require(math.isfinite(low) and math.isfinite(high) and low < high, "--reward-range", [low, high],
             "must be LOW HIGH, two finite numbers with LOW < HIGH")
    for flag, seed in (("--seed", args.seed), ("--task-seed", args.task_seed)):
        _require(0 <= seed <= 2**32 - 1, flag, seed, "must lie in [0, 2**32 - 1]")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise EvalInputError(f"{path}: {what} is not UTF-8 text ({err.reason} at byte {err.start}); the file is "
                             "damaged: save or copy it again") from None
    except ValueError as err:
        raise EvalInputError(f"{path}: {what} is not valid JSON ({err}); the file is damaged or truncated: save or "
                             "copy it again") from None
    except OSError as err:
        raise EvalInputError(f"{path}: cannot be read ({err.strerror or err})") from None


def check_agent_folder(agent: str, own_tokenizer: bool) -> None:
    """Raise :class:`EvalInputError` when ``agent`` is not a usable HF model folder (see the module).

    ``own_tokenizer``: the folder's tokenizer is used (no ``--tokenizer``), so it must be there.
    ``"smollm2"`` (the package's own model) is not checked here.
    """
    if agent == "smollm2":
        return
    folder = Path(agent).expanduser()
    if not folder.is_dir():
        raise EvalInputError(f"--agent {agent}: no such folder")
    if not (folder / "config.json").is_file():
        raise EvalInputError(f"--agent {folder}: not an HF model folder (no config.json); pass a folder written by "
                             "save_pretrained (a run's final/<agent>) or 'smollm2'")
    for name in JSON_FILES:
        if (folder / name).is_file():
            data = _read_json(folder / name, name)
            if not isinstance(data, dict):
                raise EvalInputError(f"{folder / name}: {name} must hold a JSON object, not {type(data).__name__}")
    if "model_type" not in _read_json(folder / "config.json", "config.json"):
        raise EvalInputError(f"{folder / 'config.json'}: has no model_type; not an HF model configuration")
    _check_weights(folder)
    if own_tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise EvalInputError(f"--agent {folder}: no tokenizer ({', '.join(TOKENIZER_FILES)} all missing); save the "
                             "tokenizer next to the weights (tokenizer.save_pretrained) or pass --tokenizer")


def _check_weights(folder: Path) -> None:
    """Every safetensors header reads and every file is as long as its header says (else it is named)."""
    from hacrl_megatron.models.convert import CorruptCheckpointError, SafetensorsSource

    if not any(name.endswith(".safetensors") or name == "model.safetensors.index.json" for name in os.listdir(folder)):
        if any((folder / name).is_file() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            return  # torch weights: transformers reads them (weights_only)
        raise EvalInputError(f"--agent {folder}: no weights (no *.safetensors, no model.safetensors.index.json)")
    try:
        SafetensorsSource(str(folder))
    except CorruptCheckpointError as err:
        raise EvalInputError(str(err)) from None


def load_failure(what: str, folder: Path, err: BaseException) -> EvalInputError:
    """A library's error while loading ``what`` from ``folder``, as one line naming the folder."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return EvalInputError(f"--agent {folder}: the {what} cannot be loaded ({type(err).__name__}: {one_line_text(first)})")
