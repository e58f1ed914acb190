"""Renders BENCHMARKS.md, and the headline table of README.md, from benchmarks/results/.

    python benchmarks/report.py           # writes both pages
    python benchmarks/report.py --check   # exits 1, naming each page that differs, writes nothing

The results hold one folder per machine kind and in it the latest JSON per workload, each opening
with the command that ran, the commit measured and the date (``mmproxy bench`` and the scripts
write them so). The page's words live in ``_templates.py``: the method, a few lines a section and
which results each section and summary row reads. Every results file belongs to one section; a
file no section names, or a section whose file is missing, is an error, so a new workload gets its
template before the page renders.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _templates as t  # this script's folder is on the path

ROOT = Path(__file__).resolve().parents[1]  # the checkout; --root names another tree
BEGIN, END = "<!-- headline: rendered by benchmarks/report.py -->", "<!-- end of headline -->"


class Result:
    """One results file: its provenance and its systems' rates."""

    def __init__(self, path: Path, results: Path):
        self.path = path
        self.name = path.relative_to(results).as_posix()
        try:
            self.data: dict[str, Any] = json.loads(path.read_text())
        except ValueError as err:
            raise SystemExit(f"report.py: {self.name} is not JSON: {err}") from None
        missing = [k for k in ("command", "commit", "date") if not self.data.get(k)]
        if missing:
            raise SystemExit(f"report.py: {self.name} lacks {', '.join(missing)} (the bench "
                             "scripts write them; add them to a file written otherwise)")

    @property
    def link(self) -> str:
        return f"[`{self.path.name}`](benchmarks/results/{self.name})"

    def machine(self) -> str:
        if self.data.get("machine_kind"):
            return str(self.data["machine_kind"])
        m = self.data.get("machine") or {}
        gpu = m.get("gpu")
        return f"{gpu}, {m.get('cpus')} cores" if gpu else f"{m.get('cpus')}-core CPU"

    def workloads(self) -> list[str]:
        results = self.data.get("results")
        if isinstance(results, dict) and all(isinstance(v, dict) and "systems" in v
                                              for v in results.values()):
            return list(results)
        return ["video"] if "systems" in self.data else []

    def systems(self, workload: str | None = None) -> dict[str, dict[str, Any]]:
        if "systems" in self.data:
            return self.data["systems"]
        results = self.data["results"]
        return results[workload or next(iter(results))]["systems"]

    def label(self, system: str) -> str:
        """The system's name with the settings that tell its rows apart."""
        settings = self.data.get("settings") or {}
        entry = self.systems_of(system)
        words = [system]
        pipelines = entry.get("pipelines")
        if pipelines and "pipelines" in settings:
            words.append(f"{pipelines} pipeline{'s' if pipelines > 1 else ''} of "
                         f"{settings.get('threads')} threads")
        if settings.get("worker_cpus"):
            words.append(f"workers on cores {settings['worker_cpus']}")
        return ", ".join(words)

    def systems_of(self, system: str) -> dict[str, Any]:
        for workload in self.workloads() or [None]:
            found = self.systems(workload).get(system)
            if found is not None:
                return found
        raise SystemExit(f"report.py: {self.name} has no system {system!r}")


@dataclass
class Rate:
    """A system's rate in each run of one bench run, and its median."""

    runs: list[float]  # per run: sustained, or the best epoch where a run has no sustained rate
    sustained: bool

    @property
    def value(self) -> float:
        return statistics.median(self.runs)


def rate(entry: dict[str, Any]) -> Rate:
    """A system's rate per run: sustained where the bench measured it, else the best epoch."""
    sustained = "sustained_samples_per_s" in entry
    runs = entry.get("runs")
    if runs and sustained:
        return Rate([r["sustained"] for r in runs], True)
    if runs:
        return Rate([max(r["epochs"][1:] or r["epochs"]) for r in runs], False)
    return Rate([entry["sustained_samples_per_s" if sustained else "samples_per_s"]], sustained)


def number(x: float) -> str:
    """A rate: whole with thousands' commas from 1,000, else to a tenth."""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def ratio(x: float) -> str:
    """A ratio: to a hundredth below 10, else to a tenth."""
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def spread(values: Sequence[float], fmt=ratio) -> str:
    """``median (low-high)`` of ``values``, or the one figure where they round alike."""
    middle = fmt(statistics.median(values))
    if len(values) == 1 or fmt(min(values)) == fmt(max(values)):
        return middle
    return f"{middle} ({fmt(min(values))}-{fmt(max(values))})"


def unit(workload: str | None) -> str:
    return "img/s" if workload in ("image", "image-text") else "clips/s"


# -- sections ---------------------------------------------------------------------------------

def over(own: Rate | None, other: Rate, reference: Rate) -> str:
    """mmproxy's rate over ``other``'s: run by run where ``own`` is mmproxy's of the same bench
    run, else ``reference``'s median over the other's, marked as separate runs."""
    if own is None:
        return f"{ratio(reference.value / other.value)} {t.APART}"
    if len(own.runs) == len(other.runs):
        return spread([a / b for a, b in zip(own.runs, other.runs)])
    return ratio(own.value / other.value)


def systems_table(files: list[Result], reference: tuple[str, str], workload: str | None) -> str:
    """One row a system of ``files``, with mmproxy's ratio over it."""
    ref_file = next(f for f in files if f.name.endswith("/" + reference[0]))
    ref = rate(ref_file.systems(workload)[reference[1]])
    head = "sustained per run" if ref.sustained else "best epoch after the first, per run"
    rows = [f"| system | {head} | median (range) | {reference[1]} / system |",
            "| --- | ---: | ---: | ---: |"]
    for f in files:
        systems = f.systems(workload)
        for name, entry in systems.items():
            if "samples_per_s" not in entry:
                rows.append(f"| {f.label(name)} | not run: {entry.get('error', '')[:80]} | | |")
                continue
            r = rate(entry)
            if name == reference[1] and f is ref_file:
                cell = ""
            else:
                mine = systems.get(reference[1]) if name != reference[1] else None
                cell = over(rate(mine) if mine else None, r, ref)
            rows.append(f"| {f.label(name)} | {' · '.join(number(x) for x in r.runs)} "
                        f"{unit(workload)} | {spread(r.runs, number)} | {cell} |")
    return "\n".join(rows)


def provenance(files: list[Result]) -> str:
    """Per file: its link, date, code, machine and command."""
    return "\n".join(f"- {f.link}: {f.data['date']}, code {f.data['commit']}, {f.machine()}:\n"
                     f"  `{f.data['command']}`" for f in files)


def memory(f: Result) -> str:
    """The memory of a ``--memory-epochs`` run, epoch by epoch, as ranges."""
    epochs = f.data["memory"]["per_epoch"]

    def span(key: str) -> str:
        low, high = (f"{pick(e[key] for e in epochs):,.0f}" for pick in (min, max))
        return f"{low} MB" if low == high else f"{low}-{high} MB"

    return (f"**Memory over {len(epochs)} epochs** (`--memory-epochs {len(epochs)}`: every other "
            f"epoch abandoned after a few batches): the main process and its workers resident "
            f"{span('rss_mb')}, `/dev/shm` {span('dev_shm_mb')}, the kernel's shared memory "
            f"{span('shmem_mb')}, at most {max(e['server_runs_held'] for e in epochs)} runs held "
            "by the server after an epoch.")


def clients_table(f: Result) -> str:
    """The clients alone (``remote_bench.py``'s plain GETs), one row a client."""
    rows = ["| client | MiB/s, median (range) | CPU a MiB | a 64 KiB GET |",
            "| --- | ---: | ---: | ---: |"]
    for name, c in f.data["clients"].items():
        low, high = c["mib_per_s_range"]
        rows.append(f"| {name} | {number(c['mib_per_s'])} ({number(low)}-{number(high)}) | "
                    f"{c['cpu_ms_per_mib']:.2f} ms | {c['first_byte_ms']:.1f} ms |")
    return ("**The clients alone**: each GETs the same objects from the same servers into one "
            "buffer in the main process; `mmproxy-*` is mmproxy's own path (into a memfd, pages "
            "touched for the first time).\n\n" + "\n".join(rows))


def sweep_table(f: Result) -> str:
    rows = ["| pipelines | threads each | batch | sustained | best epoch |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    rows += [f"| {r['pipelines']} | {r['threads']} | {r['batch']} | {number(r['sustained'])} | "
             f"{number(r['best'])} |" for r in f.data["runs"]]
    return "\n".join(rows) + "\n\nImages a second, one run each."


def compare_table(f: Result) -> str:
    rows = ["| workload | code | round | mmproxy, best epoch | sustained | the reader, best epoch "
            "| mmproxy / reader |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in f.data["runs"]:
        code = f"{r['code']} ({f.data['before']})" if r["code"] == "before" else r["code"]
        cells = [number(r[k]) if r.get(k) else "–" for k in ("mmproxy", "mmproxy_sustained",
                                                             "dali_reader")]
        rows.append(f"| {r['workload']} | {code} | {r['round']} | {' | '.join(cells)} | "
                    f"{ratio(r['ratio']) if r.get('ratio') else '–'} |")
    return "\n".join(rows)


def resume_table(f: Result) -> str:
    d = f.data
    first = d["first_batch_s"]
    return ("| first batch, s: fresh | resumed at 10% | at 90% | sample-seeded / DALI-drawn "
            "throughput |\n| ---: | ---: | ---: | ---: |\n"
            f"| {first['fresh']:.2f} | {first['10%']:.2f} | {first['90%']:.2f} | "
            f"{ratio(d['seeded_vs_dali_drawn']['median'])} "
            f"({ratio(d['seeded_vs_dali_drawn']['range'][0])}-"
            f"{ratio(d['seeded_vs_dali_drawn']['range'][1])}) |\n\n"
            f"Medians of {len(d['first_batch_s_all']['fresh'])} rounds.")


def first_sample_table(f: Result) -> str:
    rows = ["| source | first sample | whole shard |", "| --- | ---: | ---: |"]
    for source, r in f.data["results"].items():
        rows.append(f"| {source} | {r['first_sample_s'] * 1000:.1f} ms | {r['whole_shard_s']:.2f} s |")
    return "\n".join(rows)


def ddp_table(f: Result) -> str:
    runs = f.data["runs"]
    rows = ["| loader | 1 GPU, img/s: best; sustained | 2 GPUs | scaling: best; sustained | "
            "share of the no-loader rate, 2 GPUs, sustained |", "| --- | ---: | ---: | ---: | ---: |"]
    ceiling = runs.get("resnet50-synthetic-2", {}).get("total_sustained_samples_per_s")
    for suffix, name in t.DDP_LOADERS:
        one, two = runs.get(f"resnet50{suffix}-1"), runs.get(f"resnet50{suffix}-2")
        if two is None:
            continue
        pair = [(r["total_samples_per_s"], r["total_sustained_samples_per_s"]) for r in (one, two)
                if r]
        rates = ["; ".join(number(x) for x in p) for p in pair]
        scale = "; ".join(ratio(b / a) for a, b in zip(*pair)) if one else ""
        share = ratio(pair[-1][1] / ceiling) if ceiling else ""
        rows.append(f"| {name} | {rates[0] if one else ''} | {rates[-1]} | {scale} | {share} |")
    commands = {name: re.sub(r"--nproc_per_node=\d", "--nproc_per_node=N", r["command"]) + " "
                for name, r in runs.items()}
    base = os.path.commonprefix(list(commands.values())).rsplit(" ", 1)[0]
    extras = {re.sub(r"-\d$", "-N", name): c[len(base):].strip() for name, c in commands.items()}
    return ("\n".join(rows) + f"\n\nEach run (`NAME-N`: N GPUs): `{base}`, and "
            + "; ".join(f"`{name}`: `{extra}`" if extra else f"`{name}`: nothing more"
                        for name, extra in extras.items()) + ".")


def profile_table(f: Result) -> str:
    columns = ["step", "train", "nccl", "nccl_only", "pipeline", "pipeline_beside_train", "idle"]
    rows = ["| run | rank | " + " | ".join(t.PROFILE_COLUMNS) + " |",
            "| --- | --- |" + " ---: |" * len(columns)]
    for r in f.data["rows"]:
        run = "no loader" if "synthetic" in r["trace"] else "mmproxy"
        rank = re.search(r"rank(\d+)", r["trace"])
        rows.append(f"| {run} | {rank.group(1) if rank else ''} | "
                    + " | ".join(f"{r[c]:.1f}" for c in columns) + " |")
    return "\n".join(rows)


def variants_table(f: Result) -> str:
    """``pipeline_cost.py``'s measurements, one row each: its own output (a measurement's name
    and its epochs), or rows merged from several of its commands (``runs``)."""
    d = f.data
    if "runs" in d:
        unit, runs = d["unit"], [(r["variant"], r["epochs"], r.get("cpu_cores_busy"))
                                 for r in d["runs"]]
    else:
        unit = "clips/s" if d["kind"] == "audio" else "images/s"
        runs = [(name, m["after_the_first"], (m.get("cpu_cores_busy") or [None])[1:] or None)
                for name, m in d.items() if isinstance(m, dict) and "after_the_first" in m]
    rows = [f"| variant | {unit}, median (range) | CPU cores busy |", "| --- | ---: | ---: |"]
    for name, epochs, cores in runs:
        rows.append(f"| {name} | {number(statistics.median(epochs))} ({number(min(epochs))}-"
                    f"{number(max(epochs))}) | "
                    f"{f'{min(cores):.1f}-{max(cores):.1f}' if cores else '–'} |")
    return "\n".join(rows) + "\n\nThree epochs after a first, no loader."


KINDS = {"variants": variants_table, "sweep": sweep_table, "compare": compare_table, "resume": resume_table,
         "first-sample": first_sample_table, "ddp": ddp_table, "profile": profile_table}


def anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def section(s: t.Section, files: dict[str, Result]) -> str:
    mine = [files[f"{s.machine}/{name}"] for name in s.files]
    parts = [f"### {s.title}", s.text.strip()]
    if s.kind == "systems":
        reference = s.reference or (s.files[0], "mmproxy")
        workloads = mine[0].workloads()
        for workload in workloads:
            if len(workloads) > 1:
                parts.append(f"**{workload}**")
            parts.append(systems_table(mine, reference, workload))
        if any(t.APART in p for p in parts):
            parts.append(f"{t.APART} {t.APART_TEXT}")
        parts += [memory(f) for f in mine if f.data.get("memory")]
        parts += [clients_table(f) for f in mine if f.data.get("clients")]
    else:
        parts.append(KINDS[s.kind](mine[0]))
    parts.append(provenance(mine))
    return "\n\n".join(p for p in parts if p)


# -- the summary ------------------------------------------------------------------------------

def cell(row: t.Row, column: str, files: dict[str, Result]) -> tuple[str, str | None]:
    """A summary cell and, where its run's date differs from the row's, that date."""
    spec = row.peers.get(column)
    if spec is None or isinstance(spec, str):
        return spec or "not run", None
    ref_file = files[f"{row.machine}/{row.mmproxy[0]}"]
    peer_file = files[f"{row.machine}/{spec[0]}"]
    systems = peer_file.systems(row.workload if row.workload in peer_file.workloads() else None)
    peer = rate(systems[spec[1]])
    ref = rate(ref_file.systems_of(row.mmproxy[1]))
    mine = systems.get(row.mmproxy[1])
    text = over(rate(mine) if mine else None, peer, ref) + ("" if peer.sustained else f" {t.BEST}")
    other = peer_file.data["date"] if peer_file.data["date"] != ref_file.data["date"] else None
    return text, other


def summary(rows: Sequence[t.Row], files: dict[str, Result], sections: dict[str, str],
            link_prefix: str = "") -> str:
    columns = list(t.COLUMNS)
    out = ["| workload | machine | " + " | ".join(t.COLUMNS.values()) + " | measured |",
           "| --- | --- |" + " ---: |" * len(columns) + " --- |"]
    for row in rows:
        ref_file = files[f"{row.machine}/{row.mmproxy[0]}"]
        cells, dates = [], []
        for column in columns:
            text, date = cell(row, column, files)
            cells.append(text)
            if date:
                dates.append(f"{t.COLUMNS[column].removeprefix('× ')} {date}")
        measured = ref_file.data["date"] + (f" ({', '.join(dates)})" if dates else "")
        where = sections[f"{row.machine}/{row.mmproxy[0]}"]
        out.append(f"| [{row.workload_text}]({link_prefix}#{anchor(where)}) | "
                   f"{t.MACHINES[row.machine]} | " + " | ".join(cells) + f" | {measured} |")
    return "\n".join(out) + "\n\n" + t.SUMMARY_LEGEND.strip()


# -- the pages --------------------------------------------------------------------------------

def load(results: Path) -> tuple[dict[str, Result], dict[str, str]]:
    """The results files by ``MACHINE/FILE`` and the title of the section that reads each."""
    files = {r.name: r for r in (Result(p, results) for p in sorted(results.glob("*/*.json")))}
    stray = sorted(p.relative_to(results).as_posix() for p in results.rglob("*")
                   if p.is_file() and (p.suffix != ".json" or p.parent.parent != results))
    if stray:
        raise SystemExit("report.py: benchmarks/results/ holds one folder per machine and JSON "
                         f"files in it, not {', '.join(stray)}")
    named: dict[str, str] = {}
    for s in t.SECTIONS:
        for name in s.files:
            key = f"{s.machine}/{name}"
            if key not in files:
                raise SystemExit(f"report.py: section {s.title!r} reads {key}, which is missing")
            named[key] = s.title
    unnamed = sorted(set(files) - set(named))
    if unnamed:
        raise SystemExit(f"report.py: no section of _templates.py reads {', '.join(unnamed)}; "
                         "give each results file a section")
    return files, named


def benchmarks_page(files: dict[str, Result], named: dict[str, str]) -> str:
    parts = [t.TITLE.strip(), "## Summary", summary(t.SUMMARY, files, named),
             t.METHOD.strip()]
    for machine, title in t.MACHINES_LONG.items():
        parts.append(f"## {title}")
        parts.append(t.MACHINE_TEXT[machine].strip())
        parts += [section(s, files) for s in t.SECTIONS if s.machine == machine]
    parts.append(t.SCRIPTS.strip())
    return "\n\n".join(parts) + "\n"


def readme_page(files: dict[str, Result], named: dict[str, str], readme: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise SystemExit(f"report.py: README.md must hold the lines {BEGIN!r} and {END!r} once "
                         "each, around the headline table")
    rows = [r for r in t.SUMMARY if r.headline]
    table = summary(rows, files, named, link_prefix="BENCHMARKS.md")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when BENCHMARKS.md or README.md differs from what renders")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the tree whose benchmarks/results/ and pages to use (default: this "
                             "checkout)")
    args = parser.parse_args(argv)
    files, named = load(args.root / "benchmarks" / "results")
    readme = args.root / "README.md"
    pages = {args.root / "BENCHMARKS.md": benchmarks_page(files, named),
             readme: readme_page(files, named, readme.read_text())}
    stale = [p.name for p, text in pages.items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            print(f"report.py: {' and '.join(stale)} differ{'s' if len(stale) == 1 else ''} from "
                  "what benchmarks/results/ renders; run python benchmarks/report.py",
                  file=sys.stderr)
            return 1
        return 0
    for path, text in pages.items():
        path.write_text(text)
    print(f"wrote {', '.join(stale) if stale else 'nothing (the pages are current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
