"""The typed config: every section's fields, their types, closed choices and resume safety.

``configs/defaults.yaml`` is what users read (values and comments); this module is what code
reads: each field of a section is declared once, with its type, its default (the same as the
YAML's: ``tests/config/test_schema.py`` holds them together), whether its value is one of a
closed set or a registered name, and whether a run may change it on resume. From these
declarations come the loader's checks (:mod:`mmvl.config.validate`), the list of keys a resume
accepts changed (:func:`resume_safe`) and the typed sections components receive
(:func:`section`). Adding a key that is safe to change on resume is one field::

    log_interval: int = knob(100, safe=True)

The registries sit below this layer: registry-backed fields name their registry kind, and the
allowed values are whatever is registered when the config is loaded (built-ins and
``env.user_dir``), never a list kept here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional, Union

from mmvl.errors import UserError, did_you_mean
from mmvl.utils.precision import MATMUL_PRECISIONS, PRECISIONS

#: closed choices, owned here and imported by the code that acts on them
PIN_MEMORY = ("auto", True, False)
BACKENDS = ("auto", "nccl", "gloo")
LR_SCALINGS = ("linear", "sqrt")
TENSORBOARD = (True, False, "auto")
RESUME = (True, False, "auto")
#: the stages a run_type names, in the order they run; MMF's spellings of test included
STAGES = ("train", "val", "test")
_STAGE_ALIASES = {"inference": "test", "predict": "test"}


def knob(default: Any = None, *, safe: bool = False, choices: tuple[Any, ...] | None = None,
         positive: bool = False, minimum: int | None = None, required: bool = False,
         registry: str | None = None, extra: tuple[Any, ...] = ()) -> Any:
    """A field: ``safe`` to change on resume; one of ``choices``; a ``positive`` integer; an integer
    of at least ``minimum``; ``required`` (a non-empty string, never null); or a name registered in
    ``registry`` (or one of ``extra``)."""
    meta = {"safe": safe, "choices": choices, "positive": positive, "minimum": minimum, "required": required,
            "registry": registry, "extra": extra}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def sub(cls: type, *, safe: bool = False) -> Any:
    """A nested section (``safe``: every key below it may change on resume)."""
    return dataclasses.field(default_factory=cls, metadata={"safe": safe, "section": True})


@dataclasses.dataclass
class EarlyStop:
    enabled: bool = knob(False)
    criteria: Optional[str] = knob(None)
    patience: int = knob(4000)
    minimize: Optional[bool] = knob(None)


@dataclasses.dataclass
class Profiler:
    enabled: bool = knob(False)
    wait: int = knob(5)
    warmup: int = knob(2)
    active: int = knob(3)


@dataclasses.dataclass
class Ema:
    decay: float = knob(0.0, safe=True)


@dataclasses.dataclass
class Training:
    trainer: str = knob("mmvl", registry="trainer")
    seed: int = knob(1)
    batch_size: int = knob(32, positive=True)
    num_workers: int = knob(4, safe=True, minimum=0)
    pin_memory: Union[str, bool] = knob("auto", safe=True, choices=PIN_MEMORY)
    persistent_workers: bool = knob(True, safe=True)
    prefetch: bool = knob(True, safe=True)
    group_by_length: bool = knob(False)
    packing: bool = knob(False, safe=True)  # the same samples each update, the same loss: only their rows change
    packing_length: Optional[int] = knob(None, safe=True, positive=True)
    max_updates: Optional[int] = knob(22000, safe=True, positive=True)
    max_epochs: Optional[float] = knob(None, safe=True, positive=True)
    log_interval: int = knob(100, safe=True)
    evaluation_interval: int = knob(1000, safe=True, minimum=0)
    checkpoint_interval: int = knob(1000, safe=True, minimum=0)
    gradient_accumulation: int = knob(1, positive=True)
    update_frequency: Optional[int] = knob(None, positive=True)
    fp16: bool = knob(False)
    precision: str = knob("fp32", choices=tuple(PRECISIONS))
    matmul_precision: str = knob("auto", safe=True, choices=MATMUL_PRECISIONS)
    clip_grad_norm: Optional[float] = knob(None)
    gradient_checkpointing: bool = knob(False)
    early_stop: EarlyStop = sub(EarlyStop, safe=True)
    ema: Ema = sub(Ema, safe=True)
    builtin_callbacks: list = knob(["profiler", "logging", "trackers", "curves", "ema", "evaluation", "early_stop",
                                    "checkpoint", "preemption"], safe=True)
    callbacks: list = knob([], safe=True)
    exit_on_nan: bool = knob(True, safe=True)
    progress_bar: bool = knob(True, safe=True)
    colored_logs: bool = knob(True, safe=True)
    trackers: list = knob(["tensorboard"], safe=True, registry="tracker")
    tracker_project: str = knob("mmvl", safe=True, required=True)
    tensorboard: Union[str, bool] = knob("auto", safe=True, choices=TENSORBOARD)
    curves: bool = knob(True, safe=True)
    device: str = knob("auto", safe=True)
    compile: bool = knob(False, safe=True)
    compile_backend: str = knob("inductor", safe=True)
    peak_tflops: Optional[float] = knob(None, safe=True)
    preemption_check_interval: int = knob(10, safe=True)
    profiler: Profiler = sub(Profiler, safe=True)


@dataclasses.dataclass
class Evaluation:
    metrics: list = knob([])
    predict: bool = knob(False)
    generate_max_samples: Optional[int] = knob(None, safe=True, positive=True)


@dataclasses.dataclass
class Multitasking:
    type: str = knob("size_proportional", registry="multitasking")
    params: dict = knob({})


@dataclasses.dataclass
class Optimizer:
    type: str = knob("adam_w", registry="optimizer")
    params: dict = knob({"lr": 5.0e-05, "eps": 1.0e-08, "weight_decay": 0.01})
    lr_scaling: Optional[str] = knob("none", choices=("none", *LR_SCALINGS, None))
    no_weight_decay: list = knob(["logit_scale", "logit_bias"])
    param_groups: list = knob([])
    layer_decay: float = knob(1.0)
    enable_state_sharding: bool = knob(False)


@dataclasses.dataclass
class Scheduler:
    type: Optional[str] = knob("warmup_linear", registry="scheduler", extra=(None,))
    params: dict = knob({"num_warmup_steps": 1000, "num_training_steps": None})


@dataclasses.dataclass
class Nccl:
    nsocks_perthread: Optional[int] = knob(None)
    socket_nthreads: Optional[int] = knob(None)


@dataclasses.dataclass
class Distributed:
    strategy: str = knob("auto", registry="strategy", extra=("auto",))
    backend: str = knob("auto", choices=BACKENDS)
    world_size: int = knob("${device_count:}", minimum=1)
    rank: int = knob(0)
    port: int = knob(-1)
    init_method: Optional[str] = knob(None)
    local_rank: Optional[int] = knob(None)
    timeout_minutes: int = knob(30)
    max_restarts: int = knob(0, minimum=0)
    data_parallel: bool = knob(False)
    find_unused_parameters: bool = knob(False)
    static_graph: bool = knob(False)
    bucket_cap_mb: int = knob(25)
    gradient_as_bucket_view: bool = knob(False)
    broadcast_buffers: bool = knob(True)
    reduce_buffer_size: int = knob(8388608)
    broadcast_fp16: bool = knob(False)
    reshard_after_forward: bool = knob(True)
    sharded_checkpoint: bool = knob(False)
    nccl: Nccl = sub(Nccl)


@dataclasses.dataclass
class Reset:
    optimizer: bool = knob(False)
    scheduler: bool = knob(False)
    counts: bool = knob(False)


@dataclasses.dataclass
class Checkpoint:
    resume: Union[str, bool] = knob("auto", choices=RESUME)
    resume_file: Optional[str] = knob(None)
    resume_best: bool = knob(False)
    resume_pretrained: bool = knob(False)
    pretrained_state_mapping: dict = knob({})
    reset: Reset = sub(Reset)
    max_to_keep: int = knob(3, minimum=0)
    slurm_requeue: bool = knob(False)


@dataclasses.dataclass
class Env:
    save_dir: str = knob("${env:MMVL_SAVE_DIR,./save}", required=True)
    data_dir: str = knob("${env:MMVL_DATA_DIR,./data}", required=True)
    cache_dir: Optional[str] = knob("${env:MMVL_CACHE_DIR,null}")
    user_dir: Optional[str] = knob("${env:MMVL_USER_DIR,null}")
    tensorboard_logdir: Optional[str] = knob(None)
    wandb_logdir: Optional[str] = knob(None)


@dataclasses.dataclass
class Run:
    """The whole config: the top-level keys and one typed section each."""
    run_type: str = knob("train_val", safe=True)
    model: Optional[str] = knob(None)
    datasets: list = knob([])
    training: Training = sub(Training)
    evaluation: Evaluation = sub(Evaluation, safe=True)
    multitasking: Multitasking = sub(Multitasking)
    optimizer: Optimizer = sub(Optimizer)
    scheduler: Scheduler = sub(Scheduler)
    distributed: Distributed = sub(Distributed, safe=True)
    checkpoint: Checkpoint = sub(Checkpoint, safe=True)
    env: Env = sub(Env, safe=True)
    model_config: dict = knob({})
    dataset_config: dict = knob({})


def fields(cls: type = Run, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf field below ``cls`` by dotted key (sections recursed)."""
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            out.update(fields(f.default_factory, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            out[f"{prefix}{f.name}"] = f
    return out


def defaults(cls: type = Run) -> dict[str, Any]:
    """The schema's defaults as the nested dict ``defaults.yaml`` must equal."""
    return dataclasses.asdict(cls())


#: keys inside free-form dicts that a resume may change: the optimizer's implementation is the
#: config's, never the checkpoint's (``mmvl.optim.restore_implementation``), e.g. ``fused=false`` to
#: continue a run saved unfused bit for bit
SAFE_PARAMS = ("optimizer.params.fused", "optimizer.params.foreach")


def resume_safe(key: str) -> bool:
    """Whether a resumed run may differ from its checkpoint's config at dotted ``key``: its field,
    or a section above it, is declared ``safe`` (or it is one of :data:`SAFE_PARAMS`). Keys the
    schema does not know (model and dataset settings) are not."""
    if key in SAFE_PARAMS:
        return True
    cls: Any = Run
    for part in key.split("."):
        match = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if match is None:
            return False
        if match.metadata.get("safe"):
            return True
        if not match.metadata.get("section"):
            return False
        cls = match.default_factory
    return False


def declared(key: str) -> bool:
    """Whether dotted ``key`` names a field of the schema, or lies below a ``dict`` field (``params``,
    ``model_config``, ...), whose keys are open. Keys whose first part is no section (a model's own
    settings, read from its ``model_config`` entry) are not the schema's to judge: True."""
    cls: Any = Run
    for depth, part in enumerate(key.split(".")):
        match = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if match is None:
            return depth == 0
        if not match.metadata.get("section"):
            return True  # a leaf (a dict leaf holds open keys; below any other leaf is the value)
        cls = match.default_factory
    return True


#: keys whose change on resume only ``checkpoint.reset.<name>`` may take on (``*``: any one name):
#: a changed ``freeze`` changes which parameters the saved optimizer state belongs to
NEEDS_RESET = {"model_config.*.freeze": "optimizer"}


def reset_needed(key: str) -> str | None:
    """The ``checkpoint.reset`` switch a change of dotted ``key`` on resume needs, beyond any reset
    (None: any reset takes the change on)."""
    parts = key.split(".")
    for pattern, reset in NEEDS_RESET.items():
        want = pattern.split(".")
        if len(want) == len(parts) and all(w in ("*", p) for w, p in zip(want, parts)):
            return reset
    return None


def parse_run_type(value: Any, source: str = "the config") -> str:
    """``run_type`` as the stages it names, canonically spelled (``train_val_test``).

    Any combination of train, val and test joined by ``_``, with MMF's ``inference`` and
    ``predict`` for test (``train_inference``, ``train_val_inference``)."""
    parts = str(value).lower().split("_") if isinstance(value, str) and value else []
    stages = [_STAGE_ALIASES.get(p, p) for p in parts]
    unknown = [p for p, s in zip(parts, stages) if s not in STAGES]
    if not stages or unknown:
        hint = did_you_mean(unknown[0], [*STAGES, *_STAGE_ALIASES]) if unknown else ""
        raise UserError(f"run_type={value!r} (from {source}) must be one of train, val, test, or several "
                        f"joined by '_' (e.g. train_val, train_val_test; MMF's inference and predict mean "
                        f"test).{hint}")
    return "_".join(s for s in STAGES if s in stages)


def stages(config: Any) -> frozenset[str]:
    """The stages ``config.run_type`` runs (``{"train", "val"}`` for train_val)."""
    run_type = config.get("run_type") if isinstance(config, Mapping) else getattr(config, "run_type", None)
    return frozenset(parse_run_type(run_type or "train_val").split("_"))


def section(config: Any, name: str) -> Any:
    """The typed section ``name`` (``training``, ``distributed``, ...) of a loaded config: a
    dataclass whose fields are the config's values (nested sections typed too)."""
    match = next((f for f in dataclasses.fields(Run) if f.name == name and f.metadata.get("section")), None)
    if match is None:
        raise KeyError(f"{name!r} is not a typed config section")
    values = config.get(name) if isinstance(config, Mapping) else getattr(config, name)
    if isinstance(values, match.default_factory):  # already typed (e.g. the Engine's sections)
        return values
    return _build(match.default_factory, values or {})


def typed_section(config: Any, name: str) -> Any:
    """The typed section ``name`` of ``config`` (None: the schema's defaults). A field set to null
    takes its declared default, as a dotted look-up with that default did; a default that is an
    interpolation (``${device_count:}``, resolved only when a config is loaded) reads as unset."""
    typed = section(config if config is not None else {}, name)
    changes = {}
    for f in dataclasses.fields(typed):
        value = getattr(typed, f.name)
        if value is None and f.default is not dataclasses.MISSING:
            value = changes[f.name] = f.default
        if isinstance(value, str) and value.startswith("${") and value == f.default:
            changes[f.name] = None
    return dataclasses.replace(typed, **changes) if changes else typed


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if f.metadata.get("section"):
            value = _build(f.default_factory, value or {})  # type: ignore[arg-type]
        elif type(value).__module__.startswith("omegaconf"):
            from omegaconf import OmegaConf

            value = OmegaConf.to_container(value, resolve=True)
        kwargs[f.name] = value
    return cls(**kwargs)
