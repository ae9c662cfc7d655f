"""The method-comparison data set (the ACL 2025 comparison of methods for factual recall): about 2,000 facts stratified by relation, subject
frequency band and answer uniqueness.

Built by :func:`build_methods2k` from the LRE factual relations (first prompt template) and ROME's
known_1000 (its given prompts), written as one JSON file (``methods2k.json``) that
:func:`load_methods2k` reads back (``--dataset methods2k:DIR``, DIR holding the file, or the file
itself; ``methods2k`` alone builds it from the public LRE and known_1000 with the defaults).

Every fact carries its tags in the example's ``meta`` (so SQL selects strata with
``meta->>'freq_band' = 'high'``):

    source       lre | known1000
    zipf         the frequency proxy of the subject: ``wordfreq.zipf_frequency(subject, "en")``
                 (log10 of occurrences per billion words, in wordfreq's combined English list;
                 a multi-word subject gets wordfreq's combined frequency of its words), unless
                 the builder is given its own table
    freq_band    high | low: "high" when the subject's zipf is strictly above the median zipf of
                 its relation's subjects (in the whole pool, before sampling), else "low" (so
                 ties at the median go low, and a relation whose subjects all share one value has
                 no high band)
    n_objects    distinct objects the subject has in its relation (in the pool)
    uniqueness   unique (n_objects = 1) | several (n_objects > 1)
    object_subjects  subjects of the relation that share this fact's object (many-to-one
                 relations: continents, languages)
    stratum      "<relation>|<freq_band>|<uniqueness>"

Sampling (:func:`stratified_sample`): each stratum gets the same quota, capped at its size, and
the facts the small strata cannot use are shared equally among the others (water-filling), so
rare strata (the "several" facts) are kept whole; within a stratum a seeded shuffle picks the
facts.  The same sources, size and seed give the same file.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from actstore.core.dependencies import wordfreq
from actstore.core.errors import DatasetError, MissingDependency
from actstore.ingest.datasets.common import (
    Collector,
    DatasetResult,
    clean_name,
    existing,
    fill_template,
    find_span,
    json_files,
    read_json,
    select_relations,
    string_list,
)
from actstore.ingest.datasets.known1000 import read_known1000
from actstore.ingest.records import PromptRecord

FILE_NAME = "methods2k.json"
FORMAT = "actstore-methods2k/1"
DEFAULT_SIZE = 2000
# Year objects: the first token is the same for every fact, so "answered" says nothing.
DEFAULT_EXCLUDE = ("presidents_birth_year", "presidents_election_year")

Frequency = Callable[[str], float]


@dataclass(frozen=True)
class Fact:
    """One tagged fact of the data set (a row of ``methods2k.json``)."""

    source: str
    relation_id: str
    relation_name: str
    subject: str
    object: str
    prompt: str
    subject_start: int
    subject_end: int
    zipf: float = 0.0
    freq_band: str = ""
    n_objects: int = 1
    uniqueness: str = ""
    object_subjects: int = 1

    @property
    def stratum(self) -> str:
        return f"{self.relation_id}|{self.freq_band}|{self.uniqueness}"


def wordfreq_zipf() -> Frequency:
    """The default frequency proxy: ``wordfreq.zipf_frequency(text, "en")`` (extra ``methods``)."""
    try:
        zipf_frequency = wordfreq.zipf_frequency
    except MissingDependency:
        raise DatasetError(
            "the methods2k frequency proxy needs the wordfreq package "
            "(pip install 'actstore[methods]'), or pass a frequency table"
        ) from None
    return lambda text: float(zipf_frequency(text, "en"))


# ------------------------------------------------------------------------------------ sources


def lre_facts(path: str | Path, *, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> list[Fact]:
    """Facts of LRE relation files (a file or a folder, e.g. ``data/factual``), first template each."""
    p = existing(path, "lre")
    out: list[Fact] = []
    for stem, f in json_files(p).items():
        if stem in exclude:
            continue
        data = read_json(f)
        if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
            raise DatasetError(
                f"{f}: expected an LRE relation object with 'name', 'prompt_templates', 'samples'"
            )
        template = string_list(data.get("prompt_templates"), "'prompt_templates'", f)[0]
        for s in data["samples"]:
            if not (
                isinstance(s, dict) and isinstance(s.get("subject"), str) and isinstance(s.get("object"), str)
            ):
                raise DatasetError(f"{f}: every sample needs string 'subject' and 'object'")
            subject, obj = clean_name(s["subject"]), clean_name(s["object"])
            if not subject or not obj:
                continue
            try:
                text, (a, b) = fill_template(template, subject)
            except ValueError as e:
                raise DatasetError(f"{f}: {e}") from None
            out.append(Fact("lre", stem, str(data.get("name", stem)), subject, obj, text, a, b))
    return out


def known1000_facts(path: str | Path) -> list[Fact]:
    """Facts of ROME's known_1000 (its given prompts; records whose subject is not in the prompt are left out)."""
    _, data = read_known1000(path)
    out = []
    for x in data:
        span = find_span(x["prompt"], x["subject"])
        if span is None or not x["attribute"].strip():
            continue
        out.append(
            Fact(
                "known1000",
                x["relation_id"],
                x["relation_id"],
                x["subject"],
                x["attribute"].strip(),
                x["prompt"],
                span[0],
                span[1],
            )
        )
    return out


# ------------------------------------------------------------------------------------ tags


def tag_facts(facts: Sequence[Fact], frequency: Frequency | Mapping[str, float]) -> list[Fact]:
    """``facts`` with zipf, freq_band, n_objects, uniqueness and object_subjects filled in (see the
    module docstring); ``frequency`` maps a subject to its zipf value (a callable or a table)."""
    freq = frequency if callable(frequency) else _table(frequency)
    zipf = {s: float(freq(s)) for s in sorted({f.subject for f in facts})}
    objects: dict[tuple[str, str], set[str]] = defaultdict(set)
    subjects: dict[tuple[str, str], set[str]] = defaultdict(set)
    rel_subjects: dict[str, set[str]] = defaultdict(set)
    for f in facts:
        objects[(f.relation_id, f.subject)].add(f.object)
        subjects[(f.relation_id, f.object)].add(f.subject)
        rel_subjects[f.relation_id].add(f.subject)
    median = {r: statistics.median(zipf[s] for s in subs) for r, subs in rel_subjects.items()}
    out = []
    for f in facts:
        n = len(objects[(f.relation_id, f.subject)])
        out.append(
            Fact(
                **{
                    **asdict(f),
                    "zipf": round(zipf[f.subject], 4),
                    "freq_band": "high" if zipf[f.subject] > median[f.relation_id] else "low",
                    "n_objects": n,
                    "uniqueness": "unique" if n == 1 else "several",
                    "object_subjects": len(subjects[(f.relation_id, f.object)]),
                }
            )
        )
    return out


def _table(table: Mapping[str, float]) -> Frequency:
    def look(subject: str) -> float:
        if subject not in table:
            raise DatasetError(f"the frequency table has no entry for the subject {subject!r}")
        return float(table[subject])

    return look


# ------------------------------------------------------------------------------------ sampling


def allocate(sizes: Mapping[str, int], total: int) -> dict[str, int]:
    """How many facts each stratum gives: equal shares capped at the stratum's size, the rest
    shared among the larger strata (water-filling); leftover units go to strata in key order."""
    if total < 0:
        raise DatasetError(f"the data set size must be >= 0, not {total}")
    keys = sorted(sizes)
    take = {k: 0 for k in keys}
    left = min(total, sum(sizes.values()))
    open_ = [k for k in keys if sizes[k] > 0]
    while left > 0 and open_:
        share = left // len(open_)
        if share == 0:
            for k in open_[:left]:
                take[k] += 1
            break
        for k in open_:
            add = min(share, sizes[k] - take[k])
            take[k] += add
            left -= add
        open_ = [k for k in open_ if take[k] < sizes[k]]
    return take


def stratified_sample(facts: Sequence[Fact], total: int, seed: int = 0) -> list[Fact]:
    """About ``total`` facts (exactly, when the pool has that many), by :func:`allocate` over the
    strata and a seeded shuffle within each; returned in pool order."""
    by: dict[str, list[int]] = defaultdict(list)
    for i, f in enumerate(facts):
        by[f.stratum].append(i)
    quota = allocate({k: len(v) for k, v in by.items()}, total)
    keep: list[int] = []
    for k in sorted(by):
        idx = list(by[k])
        random.Random(f"{seed}:{k}").shuffle(idx)
        keep.extend(idx[: quota[k]])
    return [facts[i] for i in sorted(keep)]


def strata_sizes(facts: Sequence[Fact]) -> dict[str, int]:
    """Facts per stratum, in key order."""
    return dict(sorted(Counter(f.stratum for f in facts).items()))


# ------------------------------------------------------------------------------------ build / load


def build_methods2k(
    lre: str | Path | None,
    known: str | Path | None,
    out: str | Path,
    *,
    size: int = DEFAULT_SIZE,
    seed: int = 0,
    frequency: Frequency | Mapping[str, float] | None = None,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
) -> Path:
    """Tag the pool of ``lre`` (LRE relation files: use the ``factual`` folder) and ``known``
    (known_1000.json) facts (a (relation, subject, object) repeated in the sources counted once), sample ``size`` of them and write ``out/methods2k.json``; returns its path."""
    if lre is None and known is None:
        raise DatasetError("methods2k needs LRE relation files, known_1000 or both")
    pool = (lre_facts(lre, exclude=exclude) if lre is not None else []) + (
        known1000_facts(known) if known is not None else []
    )
    if not pool:
        raise DatasetError("methods2k: the sources hold no facts")
    seen: set[tuple[str, str, str]] = set()
    unique = []
    for f in pool:  # a fact repeated in the sources (20 in LRE) is kept once, where it first occurs
        if (f.relation_id, f.subject, f.object) not in seen:
            seen.add((f.relation_id, f.subject, f.object))
            unique.append(f)
    pool = unique
    tagged = tag_facts(pool, frequency if frequency is not None else wordfreq_zipf())
    chosen = stratified_sample(tagged, size, seed)
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "size": len(chosen),
        "seed": seed,
        "pool": len(tagged),
        "frequency_proxy": "wordfreq zipf_frequency(subject, 'en')" if frequency is None else "given table",
        "excluded_relations": list(exclude),
        "pool_strata": strata_sizes(tagged),
        "strata": strata_sizes(chosen),
        "facts": [{**asdict(f), "stratum": f.stratum} for f in chosen],
    }
    path = folder / FILE_NAME
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


_FIELDS = {
    "source": str,
    "relation_id": str,
    "relation_name": str,
    "subject": str,
    "object": str,
    "prompt": str,
    "subject_start": int,
    "subject_end": int,
    "zipf": float,
    "freq_band": str,
    "n_objects": int,
    "uniqueness": str,
    "object_subjects": int,
}


def read_methods2k(path: str | Path) -> list[Fact]:
    """The facts of a built data set (the folder holding ``methods2k.json``, or the file)."""
    p = existing(path, "methods2k")
    f = p / FILE_NAME if p.is_dir() else p
    if not f.exists():
        raise DatasetError(
            f"{p}: no {FILE_NAME} (build it with actstore.ingest.datasets.methods2k.build_methods2k)"
        )
    doc = read_json(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("facts"), list):
        raise DatasetError(f"{f}: not a methods2k data set (expected format {FORMAT!r})")
    out = []
    for i, row in enumerate(doc["facts"]):
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), t if t is not float else (int, float)) for k, t in _FIELDS.items()
        ):
            raise DatasetError(f"{f}: fact {i} lacks one of {', '.join(_FIELDS)}")
        fact = Fact(**{k: row[k] for k in _FIELDS})
        if (
            not (0 <= fact.subject_start < fact.subject_end <= len(fact.prompt))
            or fact.prompt[fact.subject_start : fact.subject_end] != fact.subject
        ):
            raise DatasetError(f"{f}: fact {i}: the subject span does not hold {fact.subject!r}")
        out.append(fact)
    return out


def load_methods2k(
    path: str | Path | None, *, relations: Sequence[str] | None = None, limit_per_relation: int | None = None
) -> DatasetResult:
    """Prompt records of a built methods2k data set, their tags in ``meta``.  ``path`` None builds
    the default data set from the public LRE and known_1000 (:mod:`actstore.ingest.datasets.registry`) into
    the data set cache first."""
    if path is None:
        import actstore.ingest.datasets.registry as registry

        lre_root = registry.fetch("lre")
        factual = lre_root / "data" / "factual" if (lre_root / "data" / "factual").is_dir() else lre_root
        target = registry.dataset_cache_dir() / "methods2k"
        if not (target / FILE_NAME).exists():
            build_methods2k(factual, registry.fetch("known1000"), target)
        path = target
    facts = read_methods2k(path)
    where = Path(path)
    available = list(dict.fromkeys(f.relation_id for f in facts))
    wanted = set(select_relations(available, relations, where))
    out = Collector(limit_per_relation)
    for f in facts:
        if f.relation_id not in wanted:
            continue
        meta = {
            "source_set": f.source,
            "zipf": f.zipf,
            "freq_band": f.freq_band,
            "n_objects": f.n_objects,
            "uniqueness": f.uniqueness,
            "object_subjects": f.object_subjects,
            "stratum": f.stratum,
        }
        out.add(
            PromptRecord(
                text=f.prompt,
                relation_id=f.relation_id,
                relation_name=f.relation_name,
                subject=f.subject,
                object=f.object,
                subject_span=(f.subject_start, f.subject_end),
                source="methods2k",
                meta=meta,
            )
        )
    return out.result()
