"""How a pooling model pools, read from its directory without torch (the HTTP process asks too).

A sentence-transformers directory says it in ``modules.json``: its Pooling module's ``config.json``
(``pooling_mode`` lasttoken / mean / cls, or the older ``pooling_mode_lasttoken: true`` keys) and
whether a Normalize module follows. Without it, a decoder pools its last token and normalizes (the
Qwen3-Embedding recipe, and vLLM's default for a decoder). Matryoshka support comes from config.json
(``is_matryoshka`` / ``matryoshka_dimensions``, as vLLM reads them).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xinserve.engines.pooling.params import PoolingParams, PoolingTask

POOLING_METHODS = ("lasttoken", "mean", "cls")
_OLD_MODE_KEYS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True, slots=True)
class PoolerSpec:
    task: PoolingTask  # what the served model does
    method: str  # one of POOLING_METHODS
    normalize: bool  # an embedding's default
    hidden_size: int
    # Matryoshka: None = none declared (``dimensions`` refused); () = any size up to hidden_size
    matryoshka_dimensions: tuple[int, ...] | None = None
    score_tokens: tuple[str, str] | None = None  # (false, true): a causal LM scored by two logits

    @property
    def reads_every_row(self) -> bool:
        """Mean and CLS pooling read every prompt row: a prefix-cache hit would skip some."""
        return self.method != "lasttoken"

    def check(self, params: PoolingParams) -> None:
        """Raise ValueError (a 400) for params this model cannot serve."""
        if params.task != self.task:
            raise ValueError(f"this model serves {self.task}, not {params.task} (its convert is {self.task})")
        dims = params.dimensions
        if dims is None:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError("this model does not support Matryoshka representation: dimensions cannot be "
                             "changed (config.json declares neither is_matryoshka nor matryoshka_dimensions)")
        if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            raise ValueError(f"this model supports dimensions {list(self.matryoshka_dimensions)}, got {dims}")
        if dims > self.hidden_size:
            raise ValueError(f"dimensions must be at most the model's hidden size {self.hidden_size}, got {dims}")


def pooling_info(spec: PoolerSpec, id2label: dict[int, str] | None) -> dict[str, Any]:
    """What the HTTP process needs of a pooling worker (its ``Ready`` info): the task, the embedding size,
    the Matryoshka sizes (None: none; []: any), a classifier's label names."""
    labels = [id2label[i] for i in sorted(id2label)] if id2label and spec.score_tokens is None else None
    return {"task": spec.task, "labels": labels, "method": spec.method, "normalize": spec.normalize, "hidden_size": spec.hidden_size,
            "matryoshka_dimensions": None if spec.matryoshka_dimensions is None else list(spec.matryoshka_dimensions),
            "score_tokens": None if spec.score_tokens is None else list(spec.score_tokens)}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def architecture(model_dir: str) -> str:
    """``config.json``'s first architecture; "" when there is none or no readable file (the loader says why)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    return str((config.get("architectures") or [""])[0]) if isinstance(config, dict) else ""


def resolve_runner(model_dir: str, runner: str, convert: str | None) -> tuple[str, str | None]:
    """(runner, convert) with "auto" and an unset convert decided from the directory."""
    arch = architecture(model_dir)
    is_classifier = arch.endswith("ForSequenceClassification")
    pooling_only = is_classifier or (arch.endswith("Model") and not arch.endswith("ForCausalLM"))
    if runner == "auto":
        runner = "pooling" if pooling_only or convert or (Path(model_dir) / "modules.json").is_file() else "generate"
    if runner == "generate":
        if pooling_only:
            raise ValueError(f"{arch} has no LM head to generate with: serve it with runner pooling")
        return runner, None
    return runner, convert or ("classify" if is_classifier else "embed")


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool]:
    """(pooling method or None, whether a Normalize module follows) from ``modules.json``."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = _read_json(modules_file)
    method, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            method = _pooling_mode(_read_json(model_dir / module.get("path", "") / "config.json"))
        elif not kind.endswith(".Transformer"):  # a Dense projection, ...: its output would differ
            raise ValueError(f"sentence-transformers module {kind!r} is not supported; supported: Transformer, "
                             "Pooling, Normalize")
    return method, normalize


def _pooling_mode(config: dict[str, Any]) -> str:
    if config.get("include_prompt", True) is False:
        raise ValueError("sentence-transformers pooling with include_prompt false is not supported")
    mode = config.get("pooling_mode") or next((m for key, m in _OLD_MODE_KEYS.items() if config.get(key)), None)
    if mode not in POOLING_METHODS:
        raise ValueError(f"sentence-transformers pooling {mode or config!r} is not supported; supported: "
                         f"{', '.join(POOLING_METHODS)}")
    return mode


def read_pooler_spec(model_dir: str, convert: str, classifier_from_token: str | None) -> PoolerSpec:
    """The pooling of the model at ``model_dir`` served with ``convert`` (embed / classify)."""
    config = _read_json(Path(model_dir) / "config.json")
    method, normalize = _sentence_transformers_pooling(Path(model_dir))
    if method is None:
        method, normalize = "lasttoken", True
    matryoshka: tuple[int, ...] | None = None
    if config.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        matryoshka = ()
    score_tokens = None
    if classifier_from_token is not None:
        parts = [t for t in classifier_from_token.split(",")]
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"classifier_from_token names two tokens false,true, got {classifier_from_token!r}")
        score_tokens = (parts[0], parts[1])
    elif convert == "classify" and not architecture(model_dir).endswith("ForSequenceClassification"):
        raise ValueError("convert classify on a causal LM needs classifier_from_token (e.g. no,yes): the tokens "
                         "whose logits give its score")
    return PoolerSpec(convert, method, normalize, int(config["hidden_size"]), matryoshka, score_tokens)
