"""Claim: a full-size VQA v2 starts in seconds and trains and evaluates in bounded memory.

Generates a synthetic VQA v2 at its real size (``--scale 1``: 443,757 train questions over
82,783 images, 214,354 val questions over 40,504 images, ten human answers each) in the
official file layout, with small region features (36 x 64 fp16 plus boxes) in one LMDB,
then runs ``datasets=vqa2`` with a small ``visual_bert`` and 2 DataLoader workers twice,
each in its own process:

1. *first*: an empty preprocessing cache; trains ``--updates`` updates (default: one full
   pass over the train split);
2. *cached*: the same cache; trains ``--cached-updates`` updates, then evaluates the whole
   val split (progress bar on a pseudo-terminal).

While they run it samples ``/proc/<pid>/smaps_rollup`` of the main process and of every
DataLoader worker. It reports the start-up (launch to the end of the first update), the
training samples/s, the main process's peak RSS (its ``VmHWM``) during training, each
worker's private memory (``Private_Dirty``: pages written or copied in that worker; page
cache of memory-mapped files is not a copy) at its first and last sample, and the peak RSS
during evaluation (``VmHWM`` reset with ``/proc/self/clear_refs`` when it starts). Timings
depend on the machine's load; memory figures do not.

    python benchmarks/vqa_scale.py --scale 1 --data-dir /work/data_scale/s1   # generated once (~2 min), reused
    python benchmarks/vqa_scale.py --scale 0.01                               # CI-sized
    # also a baseline's first run (e.g. `git worktree add /tmp/main main`), printed as ratios ours/baseline
    python benchmarks/vqa_scale.py --scale 1 --data-dir /work/data_scale/s1 --baseline-root /tmp/main

With ``--baseline-root`` a ``vqa_scale_vs_baseline first_startup=<ours/theirs> ...`` line
comes before the summary. ``--threads 1`` keeps timings usable on a loaded machine (two
OpenMP threads spin against other jobs' processes).

The last line is ``vqa_scale scale=<s> startup_s=<first> cached_startup_s=<second>
samples_per_s=<x> main_peak_mb=<m> worker_private_growth_mb=<w> eval_peak_mb=<e>``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FULL = {"train": (82_783, 443_757), "val": (40_504, 214_354)}
COCO = {"train": "train2014", "val": "val2014"}
BOXES, DIM = 36, 64
GENERATOR_VERSION = 1


# -- synthetic VQA v2 ----------------------------------------------------------------------------
def _words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct pronounceable pseudo-words (the question and answer vocabularies)."""
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    out: dict[str, None] = {}
    while len(out) < n:
        k = int(rng.integers(1, 4))
        out["".join(syllables[int(i)] for i in rng.integers(0, len(syllables), k))] = None
    return list(out)


TEMPLATES = ["what color is the {0}?", "how many {0} are on the {1}?", "is the {0} {2}?",
             "what is the {0} {2} {1} doing?", "where is the {0}?", "is there a {0} near the {1}?",
             "what kind of {0} is this?", "why is the {0} {2}?", "what is on the {1} next to the {0}?"]


def _answers(rng: np.random.Generator) -> list[str]:
    """~22,000 raw answers, frequent ones first, with case/punctuation variants that normalise together."""
    base = ["yes", "no"] + [str(i) for i in range(21)] + _words(rng, 18_000)
    base += [f"{a} {b}" for a, b in zip(base[30:3030], base[3030:6030])]
    variants = ["Yes", "No.", "YES", "2,000", "t-shirt", "Red.", "3.5", " no "]
    return base + variants


def _zipf(rng: np.random.Generator, n_items: int, size: int, s: float = 1.07) -> np.ndarray:
    p = 1.0 / np.arange(2, n_items + 2) ** s
    return rng.choice(n_items, size=size, p=p / p.sum())


def generate(data_dir: Path, scale: float, seed: int = 0) -> dict[str, Any]:
    """Write ``<data_dir>/vqa2`` (questions, annotations, features LMDB) unless it exists for these params."""
    base = data_dir / "vqa2"
    meta = {"scale": scale, "seed": seed, "version": GENERATOR_VERSION}
    marker = base / "generated.json"
    if marker.is_file() and json.loads(marker.read_text()).get("params") == meta:
        return json.loads(marker.read_text())
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    nouns, adjectives = _words(rng, 9_000), _words(rng, 5_000)
    answers = _answers(rng)
    escaped = [json.dumps(a) for a in answers]
    n_img = {s: max(2, round(FULL[s][0] * scale)) for s in FULL}
    n_q = {s: max(n_img[s], round(FULL[s][1] * scale)) for s in FULL}
    ids = rng.permutation(np.arange(1, 600_000))[: n_img["train"] + n_img["val"]]
    image_ids = {"train": np.sort(ids[: n_img["train"]]), "val": np.sort(ids[n_img["train"]:])}
    info: dict[str, Any] = {"params": meta, "questions": {}, "images": {}}
    for split in ("train", "val"):
        sub = COCO[split]
        per_image = np.full(n_img[split], n_q[split] // n_img[split])
        per_image[rng.permutation(n_img[split])[: n_q[split] - int(per_image.sum())]] += 1
        image_of = np.repeat(image_ids[split], per_image)
        k = np.concatenate([np.arange(c) for c in per_image])
        qids = image_of * 1000 + k
        n = len(qids)
        tmpl = rng.integers(0, len(TEMPLATES), n)
        w0, w1, w2 = (rng.integers(0, len(nouns), n), rng.integers(0, len(nouns), n),
                      rng.integers(0, len(adjectives), n))
        main = _zipf(rng, len(answers), n)
        humans = np.where(rng.random((n, 10)) < 0.72, main[:, None], _zipf(rng, len(answers), n * 10).reshape(n, 10))
        confidence = np.array(['"yes"', '"maybe"', '"no"'])[rng.choice(3, (n, 10), p=[0.8, 0.15, 0.05])]
        qfile = base / f"v2_OpenEnded_mscoco_{sub}_questions.json"
        afile = base / f"v2_mscoco_{sub}_annotations.json"
        with open(qfile, "w", encoding="utf-8") as qf, open(afile, "w", encoding="utf-8") as af:
            qf.write('{"info": {"description": "synthetic VQA v2 (mmvl benchmarks/vqa_scale.py)"}, '
                     f'"task_type": "Open-Ended", "data_type": "mscoco", "license": {{}}, "data_subtype": "{sub}", '
                     '"questions": [')
            af.write(f'{{"info": {{}}, "license": {{}}, "data_subtype": "{sub}", "annotations": [')
            for i in range(n):
                text = TEMPLATES[tmpl[i]].format(nouns[w0[i]], nouns[w1[i]], adjectives[w2[i]])
                text = text[0].upper() + text[1:]
                sep = ", " if i else ""
                qf.write(f'{sep}{{"image_id": {image_of[i]}, "question": {json.dumps(text)}, '
                         f'"question_id": {qids[i]}}}')
                ans = ", ".join(f'{{"answer": {escaped[a]}, "answer_confidence": {c}, "answer_id": {j + 1}}}'
                                for j, (a, c) in enumerate(zip(humans[i], confidence[i])))
                af.write(f'{sep}{{"question_type": "what", "multiple_choice_answer": {escaped[main[i]]}, '
                         f'"answers": [{ans}], "image_id": {image_of[i]}, "answer_type": "other", '
                         f'"question_id": {qids[i]}}}')
            qf.write("]}")
            af.write("]}")
        info["questions"][split], info["images"][split] = n, n_img[split]
    _write_features(base / "features" / "trainval.lmdb", image_ids, rng)
    info["features"] = str(base / "features" / "trainval.lmdb")
    marker.write_text(json.dumps(info, indent=1))
    return info


def _write_features(path: Path, image_ids: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    sys.path.insert(0, str(ROOT))
    from mmvl.data.features import LMDBFeatureWriter

    total = sum(len(v) for v in image_ids.values())
    with LMDBFeatureWriter(path, map_size=int(total * (BOXES * (DIM * 2 + 16) + 256) * 1.3) + (64 << 20)) as w:
        for split, ids in image_ids.items():
            for start in range(0, len(ids), 2048):
                chunk = ids[start:start + 2048]
                feats = rng.standard_normal((len(chunk), BOXES, DIM), dtype=np.float32).astype(np.float16)
                xy = rng.uniform(0, 500, (len(chunk), BOXES, 2))
                boxes = np.concatenate([xy, xy + rng.uniform(4, 140, (len(chunk), BOXES, 2))], -1)
                for image_id, f, b in zip(chunk, feats, boxes.astype(np.float32)):
                    w.put(f"COCO_{COCO[split]}_{int(image_id):012d}", f, b, 640, 640)


# -- one measured run in a child process -----------------------------------------------------------
def _opts(args: argparse.Namespace, root: str, data_dir: Path, save_dir: Path, cache_dir: Path,
          updates: int) -> list[str]:
    feats = data_dir / "vqa2" / "features" / "trainval.lmdb"
    model = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 2,
             "intermediate_size": 2 * args.hidden, "max_position_embeddings": 64, "feature_dim": DIM,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    opts = ["model=visual_bert", "datasets=vqa2", f"env.data_dir={data_dir}", f"env.save_dir={save_dir}",
            "run_type=train", f"training.batch_size={args.batch_size}", f"training.num_workers={args.workers}",
            f"training.max_updates={updates}", "training.log_interval=200", "training.evaluation_interval=0",
            f"training.checkpoint_interval={updates + 1}", "training.progress_bar=true", "checkpoint.resume=false",
            f"scheduler.params.num_warmup_steps={min(10, updates)}", "optimizer.params.lr=0.001",
            "model_config.visual_bert.losses=[{type: logit_bce}]",
            "dataset_config.vqa2.processors.features="
            f"{{type: features, params: {{path: {feats}, max_features: {BOXES}}}}}",
            "training.callbacks=[{type: vqa_scale_probe}]"]
    opts += [f"model_config.visual_bert.{k}={v}" for k, v in model.items()]
    if _has_cache_key(root):  # an older checkout (a baseline) has no env.cache_dir
        opts.append(f"env.cache_dir={cache_dir}")
    return opts


def _has_cache_key(mmvl_root: str) -> bool:
    return "cache_dir:" in (Path(mmvl_root) / "configs" / "defaults.yaml").read_text()


def _child(spec_path: str) -> None:
    """Runs inside the measured process: build the trainer, train, evaluate, report events."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["mmvl_root"])
    events = open(spec["events"], "a", buffering=1)

    def emit(name: str, **extra: Any) -> None:
        events.write(json.dumps({"event": name, "t": time.time(), **extra}) + "\n")

    # start-up phases (see PHASES): each import here is one the run needs anyway, made early to be timed
    emit("python")
    import torch  # noqa: F401

    emit("torch")
    import transformers.models.bert.modeling_bert  # noqa: F401  (visual_bert's text encoder)

    emit("transformers")
    from mmvl import registry
    from mmvl.config import load_config
    from mmvl.trainers import Trainer
    from mmvl.trainers.callbacks.base import Callback

    class Probe(Callback):
        def on_update_end(self, info: dict[str, Any]) -> None:
            t = self.trainer
            if t.update == 1:
                cpu = os.times()
                emit("first_update", samples=info["samples"], cpu_s=cpu.user + cpu.system)
            elif t.update == t.max_updates:
                emit("last_update", updates=t.update, samples=info["samples"])

    registry.CALLBACKS.register("vqa_scale_probe", lambda trainer, **_: Probe(trainer))
    config = load_config(spec["opts"])
    emit("config")
    trainer = Trainer(config)
    emit("built")
    trainer.fit()
    emit("train_end", hwm_kb=_status(os.getpid()).get("VmHWM", 0))
    time.sleep(2 * spec["interval"])  # the sampler's last look at the train workers
    if spec["prepare_val"]:  # parse (and cache) the val split now, so the next run maps everything
        builder = trainer.builders["vqa2"]
        getattr(builder, "prepare_split", builder.build)("val")
        emit("val_prepared")
    if spec["evaluate"]:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM: the evaluation's own peak
        emit("eval_start", samples=len(trainer.builders["vqa2"].build("val")))
        results = trainer.evaluate("val")
        emit("eval_end", hwm_kb=_status(os.getpid()).get("VmHWM", 0), results=results)
    events.close()


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _rollup(pid: int) -> dict[str, int] | None:
    try:
        text = open(f"/proc/{pid}/smaps_rollup").read()
    except OSError:
        return None
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+):\s+(\d+) kB", text, re.M)}


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


class Sampler(threading.Thread):
    """Samples the main process and its children every ``interval`` s until stopped."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.main: list[tuple[float, int]] = []  # (time, RSS kB)
        self.workers: dict[int, list[tuple[float, dict[str, int]]]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.time()
            rollup = _rollup(self.pid)
            if rollup is None:
                break
            self.main.append((now, rollup.get("Rss", 0)))
            for child in _children(self.pid):
                r = _rollup(child)
                if r is not None:
                    self.workers.setdefault(child, []).append((now, r))
            self.done.wait(self.interval)


def measure(args: argparse.Namespace, name: str, data_dir: Path, work: Path, cache_dir: Path,
            updates: int, evaluate: bool, prepare_val: bool = False, root: str | None = None) -> dict[str, Any]:
    """One run in a child process on a pseudo-terminal; returns its events and memory samples."""
    import fcntl
    import pty
    import struct
    import termios

    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    root = root or args.mmvl_root
    spec = {"mmvl_root": str(Path(root).resolve()), "events": str(run_dir / "events.jsonl"),
            "opts": _opts(args, root, data_dir, run_dir / "save", cache_dir, updates), "evaluate": evaluate,
            "prepare_val": prepare_val, "interval": args.interval}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    env = dict(os.environ, COLUMNS="100", PYTHONUNBUFFERED="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    t_launch = time.time()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(run_dir / "spec.json")],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=str(run_dir))
    os.close(slave)
    sampler = Sampler(proc.pid, args.interval)
    sampler.start()
    chunks: list[bytes] = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    rc = proc.wait()
    sampler.done.set()
    sampler.join()
    os.close(master)
    console = b"".join(chunks).decode("utf-8", "replace")
    (run_dir / "console.txt").write_text(console)
    if rc != 0:
        sys.exit(f"vqa_scale: the {name} run failed (exit {rc}); its output:\n{console[-4000:]}")
    events = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        events[e["event"]] = e
    return {"launch": t_launch, "events": events, "sampler": sampler, "console": console, "interval": args.interval}


#: start-up phases, each ending at an event of the child: (event, what happened since the previous one)
PHASES = (("python", "interpreter"), ("torch", "import torch"), ("transformers", "import transformers' BERT"),
          ("config", "import mmvl, load_config"), ("built", "Trainer: data, model, optimizer, loader"),
          ("first_update", "first update: workers start, first batch, forward/backward/step"))


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    ev, s = run["events"], run["sampler"]
    first, last, end = ev["first_update"], ev.get("last_update", ev["first_update"]), ev["train_end"]
    out: dict[str, Any] = {"startup_s": first["t"] - run["launch"], "startup_cpu_s": first.get("cpu_s", 0.0),
                           "main_peak_mb": end["hwm_kb"] / 1024}
    if all(name in ev for name, _ in PHASES):
        times = [run["launch"]] + [ev[name]["t"] for name, _ in PHASES]
        out["phases"] = {what: b - a for (_, what), a, b in zip(PHASES, times, times[1:])}
    updates = last.get("updates", 1) - 1
    if updates > 0:
        out["samples_per_s"] = updates * last["samples"] / max(last["t"] - first["t"], 1e-9)
    workers = {}
    for pid, samples in s.workers.items():
        during = [(t, r) for t, r in samples if t <= end["t"]]  # the train loader's workers, not eval's
        if during:
            workers[pid] = {"first_private_mb": during[0][1].get("Private_Dirty", 0) / 1024,
                            "last_private_mb": during[-1][1].get("Private_Dirty", 0) / 1024,
                            "last_private_clean_mb": during[-1][1].get("Private_Clean", 0) / 1024,
                            "last_pss_mb": during[-1][1].get("Pss", 0) / 1024,
                            "seconds": during[-1][0] - during[0][0]}
    out["workers"] = workers
    if "val_prepared" in ev:
        out["val_prepare_s"] = ev["val_prepared"]["t"] - end["t"] - 2 * run["interval"]
    out["parsed"] = sorted(set(re.findall(r"preparing the (\w+ split|\w+ vocabulary)", run["console"])))
    if "eval_end" in ev:
        start, stop = ev["eval_start"], ev["eval_end"]
        out["eval_peak_mb"] = stop["hwm_kb"] / 1024
        out["eval_s"] = stop["t"] - start["t"]
        out["eval_samples_per_s"] = start["samples"] / max(out["eval_s"], 1e-9)
        out["eval_results"] = stop["results"]
        bars = [seg for seg in re.split(r"[\r\n]", run["console"]) if "eval" in seg and "%|" in seg]
        out["eval_bar"] = bars[-1].strip() if bars else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=0.01, help="fraction of VQA v2's size, 0.01 to 1")
    p.add_argument("--data-dir", default=None, help="where the data is generated once and reused "
                   "(default: a temporary folder, removed at the end)")
    p.add_argument("--work-dir", default=None, help="run folders and the preprocessing cache (default: temporary)")
    p.add_argument("--updates", type=int, default=None, help="updates of the first run (default: one pass)")
    p.add_argument("--cached-updates", type=int, default=20)
    p.add_argument("--no-eval", action="store_true", help="skip the full-split evaluation")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS of the runs (default: unset; 1 keeps timings sane on a loaded machine)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    p.add_argument("--mmvl-root", default=str(ROOT), help="the mmvl checkout to measure (e.g. an older one)")
    p.add_argument("--baseline-root", default=None, help="another mmvl checkout (e.g. main) whose first run "
                   "(empty cache) is measured before ours; prints ratios ours/baseline")
    p.add_argument("--baseline-updates", type=int, default=300, help="updates of the baseline's run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    if not 0.01 <= args.scale <= 1:
        p.error(f"--scale {args.scale} must be between 0.01 and 1")
    temps = []
    data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="vqa_scale_data_"))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="vqa_scale_work_"))
    temps += [d for d, given in ((data_dir, args.data_dir), (work, args.work_dir)) if not given]
    try:
        t0 = time.time()
        info = generate(data_dir, args.scale)
        print(f"data: {info['questions']} questions over {info['images']} images in {data_dir} "
              f"({time.time() - t0:.0f} s)", flush=True)
        cache_dir = work / "cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        train_batches = info["questions"]["train"] // args.batch_size
        updates = args.updates or train_batches
        baseline = None
        if args.baseline_root:  # the same first run on another checkout (e.g. main), before ours
            baseline = summarise(measure(args, "baseline", data_dir, work, work / "baseline_cache",
                                         args.baseline_updates, evaluate=False, root=args.baseline_root))
        first = summarise(measure(args, "first", data_dir, work, cache_dir, updates, evaluate=False,
                                  prepare_val=not args.no_eval))
        cached = summarise(measure(args, "cached", data_dir, work, cache_dir, args.cached_updates,
                                   evaluate=not args.no_eval))
        report(args, info, updates, train_batches, first, cached)
        if baseline is not None:
            compare(args, baseline, first)
        summary(args, first, cached)
    finally:
        for d in temps:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def report(args: argparse.Namespace, info: dict[str, Any], updates: int, train_batches: int,
           first: dict[str, Any], cached: dict[str, Any]) -> None:
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; mmvl at {args.mmvl_root}")
    print(f"first run : start-up {first['startup_s']:.1f} s (main process CPU {first['startup_cpu_s']:.1f} s), "
          f"{updates} updates "
          f"({updates / max(train_batches, 1):.2f} passes over train), "
          f"{first.get('samples_per_s', 0):.0f} samples/s, main peak RSS {first['main_peak_mb']:.0f} MB")
    for pid, w in sorted(first["workers"].items()):
        print(f"  worker {pid}: private {w['first_private_mb']:.1f} -> {w['last_private_mb']:.1f} MB over "
              f"{w['seconds']:.0f} s (private clean, i.e. mapped file pages: {w['last_private_clean_mb']:.0f} MB; "
              f"Pss {w['last_pss_mb']:.0f} MB)")
    print(f"first run : parsed {', '.join(first['parsed']) or 'nothing'}; val split prepared after training in "
          f"{first.get('val_prepare_s', 0):.1f} s")
    print(f"cached run: start-up {cached['startup_s']:.1f} s (main process CPU {cached['startup_cpu_s']:.1f} s), "
          f"main peak RSS {cached['main_peak_mb']:.0f} MB; "
          f"cached run: parsed {', '.join(cached['parsed']) or 'nothing'}")
    for name, run in (("first", first), ("cached", cached)):
        if "phases" in run:
            print(f"{name + ' run':10s}: start-up phases (s): "
                  + ", ".join(f"{what} {sec:.2f}" for what, sec in run["phases"].items()))
    if "eval_peak_mb" in cached:
        print(f"evaluation: {info['questions']['val']} samples in {cached['eval_s']:.1f} s "
              f"({cached['eval_samples_per_s']:.0f} samples/s), peak RSS {cached['eval_peak_mb']:.0f} MB; "
              f"results {json.dumps(cached['eval_results'])}")
        print(f"  last progress bar frame: {cached['eval_bar']}")


def summary(args: argparse.Namespace, first: dict[str, Any], cached: dict[str, Any]) -> None:
    """The one-line result, always the last line."""
    growth = max((w["last_private_mb"] - w["first_private_mb"] for w in first["workers"].values()), default=0.0)
    eval_peak = cached.get("eval_peak_mb", float("nan"))
    print(f"vqa_scale scale={args.scale:g} startup_s={first['startup_s']:.1f} "
          f"cached_startup_s={cached['startup_s']:.1f} samples_per_s={first.get('samples_per_s', 0):.0f} "
          f"main_peak_mb={first['main_peak_mb']:.0f} worker_private_growth_mb={growth:.1f} "
          f"eval_peak_mb={eval_peak:.0f}", flush=True)


def compare(args: argparse.Namespace, baseline: dict[str, Any], first: dict[str, Any]) -> None:
    """Ratios ours/baseline of the first run (start-up, its main-process CPU, main peak RSS)."""
    growth = max((w["last_private_mb"] - w["first_private_mb"] for w in baseline["workers"].values()), default=0.0)
    print(f"baseline  : {args.baseline_root}, {args.baseline_updates} updates: start-up {baseline['startup_s']:.1f} s "
          f"(main process CPU {baseline['startup_cpu_s']:.1f} s), main peak RSS {baseline['main_peak_mb']:.0f} MB, "
          f"worker private growth {growth:.1f} MB")
    if "phases" in baseline:
        print("baseline  : start-up phases (s): " + ", ".join(f"{w} {sec:.2f}" for w, sec in baseline["phases"].items()))
    print(f"vqa_scale_vs_baseline first_startup={first['startup_s'] / baseline['startup_s']:.2f} "
          f"first_startup_cpu={first['startup_cpu_s'] / max(baseline['startup_cpu_s'], 1e-9):.2f} "
          f"main_peak={first['main_peak_mb'] / baseline['main_peak_mb']:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
